"""Unpaired completions of an image-text model (KTO): rows with images -> examples carrying their image fields.

Rows are TRL 1.16's vision unpaired rows (``DataCollatorForVisionUnpairedPreference``): ``prompt``, ``completion``
and ``label`` (columns per ``--data.prompt_column``, ``completion_column``, ``label_column``) plus the row's images
(``[vision] images_column``, or one ``image``). Prompt and completion are read as one side of a preference pair with
images (``titanium.data.vision_preference.response_pieces``: a conversational prompt with its images placed as in
SFT, or plain strings whose prompt holds the image placeholders) and processed whole, with the images, by the model's
processor, so the example carries the processor's ids and image fields. Only the completion's tokens are learned.

The prompt is never cut (its image tokens must all stay): an example longer than ``seq_len`` has its completion cut
to what is left, or is dropped (and counted) when the prompt alone fills it. KTO's mismatched rows (example i's
prompt with example i - 1's completion, ``titanium.data.unpaired``) read example i's images, their per-token fields
carried over the other completion as the processor gives them to text after a prompt (``with_text_after``); each
example checks that on its own completion, and a row where it does not hold is skipped and counted. Bad rows (a
missing or unreadable image, more placeholders than images, a label that is not true or false) are skipped and
counted like other bad rows.
"""

from __future__ import annotations

from typing import Any

import torch

from titanium.config.sections import DataSection
from titanium.data.chat import RowError
from titanium.data.preference import has_target, pair_sample
from titanium.data.text import Source
from titanium.data.unpaired import UNPAIRED_FIX, UnpairedDataset, UnpairedExample, row_label
from titanium.data.vision import ImageData, cut_fields, row_images, with_text_after
from titanium.data.vision_preference import response_pieces, side
from titanium.data.vision_sft import IMAGE_FIX, source_folder


class VisionUnpairedDataset(UnpairedDataset):
    """``UnpairedDataset`` for rows with images: each ``UnpairedExample`` carries its ``images`` (module docstring)."""

    reads_images = True

    def __init__(
        self,
        data: DataSection,
        images: ImageData,
        seq_len: int,
        system_prompt: str | None = None,
        dp_rank: int = 0,
        dp_world: int = 1,
    ) -> None:
        super().__init__(data, None, seq_len, None, system_prompt, dp_rank, dp_world)  # type: ignore[arg-type]
        self.images = images

    def _read(self, item: Any, source: Source) -> tuple[list[int], list[bool], int, dict[str, torch.Tensor], bool]:
        """The row's ids (prompt + completion), which are learned, the prompt's length, its image fields and its
        label."""
        desirable = row_label(item, self.cfg)
        pictures = row_images(item, self.images.vision.images_column, source_folder(source))
        (pieces,) = response_pieces(
            item, (self.cfg.completion_column,), len(pictures), self.cfg, self.images, self.system_prompt
        )
        ids, learned, fields = side(self.images, pieces, pictures)
        prompt = next((t for t, learn in enumerate(learned) if learn), len(ids))
        if prompt and any(
            not torch.equal(fields[name], value)
            for name, value in with_text_after(fields, prompt, len(ids), self.images.layout).items()
        ):
            raise RowError(
                "the processor gives the completion's tokens other image fields than the prompt's last token, so the "
                "KL estimate's rows (this prompt with another completion) could not be made from them"
            )
        return ids, learned, prompt, fields, desirable

    def _example(self, item: Any, source: Source, row: int) -> UnpairedExample | None:
        try:
            ids, learned, n, fields, desirable = self._read(item, source)
        except RowError as e:
            self._bad_row(source, row, str(e), f"{IMAGE_FIX}; {UNPAIRED_FIX}")
            return None
        keep = min(len(ids), self.seq_len)
        completion = (ids[n:keep], learned[n:keep])
        if n >= self.seq_len or not has_target(pair_sample(ids[:n], completion)):
            self.dropped += 1
            return None
        self.truncated += len(ids) > self.seq_len
        images = cut_fields(fields, keep, self.images.layout)
        return UnpairedExample(ids[:n], completion, desirable, self.source_idx, row, images)
