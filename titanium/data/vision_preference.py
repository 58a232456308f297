"""Preference pairs of an image-text model: rows with images -> two samples sharing the prompt and its images.

Rows are TRL's vision preference rows: ``prompt``/``chosen``/``rejected`` (columns per ``--data.prompt_column``...)
plus the row's images (``[vision] images_column``, or one ``image``), one image set shared by the pair, as TRL's
``DataCollatorForVisionPreference`` shares it. Conversational rows (the prompt a list of messages; a response a
string or a list of assistant messages) get their images placed as in SFT (``place_images``) and are rendered by the
processor's chat template: the response is what the whole conversation's rendering adds to the prompt's with the
generation prompt. Plain rows (three strings) are the prompt text, which holds the processor's image placeholders
itself, then the response text, as TRL concatenates them (no EOS added). Each side is processed whole, with the
images, by ``ImageData.tokens`` (the same ids as the prompt and the response processed apart, else the row is
skipped), so a sample carries its own image fields: the same pixel values on both sides, the per-token fields
(Gemma 3's ``token_type_ids``, Llama 3.2 Vision's ``cross_attention_mask``) as long as the side.

The prompt is never cut (its image tokens must all stay): a pair longer than ``seq_len`` has both responses cut to
what is left, or is dropped when nothing is left (or with ``--dpo.on_long_pair drop``). Bad rows are skipped and
counted like other bad rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from titanium.config.sections import DataSection
from titanium.data.chat import RowError
from titanium.data.preference import PreferenceDataset, PreferencePair, Response, has_target, pair_sample
from titanium.data.text import Source
from titanium.data.vision import ImageData, cut_fields, messages_with_images, place_images, row_images
from titanium.data.vision_sft import IMAGE_FIX, source_folder, with_system

ImageSide = tuple[list[int], list[bool], dict[str, torch.Tensor]]
"""One side processed whole: its ids (prompt + response), which of them are learned, and its image fields."""
Pieces = list[tuple[str, str]]
"""A side's text pieces and their kinds (``ImageData.tokens``): the prompt, then the response."""

_FIX = f"{IMAGE_FIX}; a pair needs --data.prompt_column, --data.chosen_column and --data.rejected_column"


def response_pieces(
    item: dict, columns: Sequence[str], count: int, cfg: DataSection, images: ImageData, system_prompt: str | None
) -> list[Pieces]:
    """The (prompt, response) text pieces of each response column of ``columns`` after the row's prompt
    (``--data.prompt_column``), as TRL's vision collators join them (module docstring); ``count``: the row's images.
    ``RowError`` for a row that is neither form."""
    prompt, responses = item.get(cfg.prompt_column), [item.get(name) for name in columns]
    for name, value in zip((cfg.prompt_column, *columns), (prompt, *responses)):
        if value is None:
            raise RowError(f"no '{name}' column (columns: {sorted(item)})")
    if all(isinstance(value, str) for value in (prompt, *responses)):  # plain text: the placeholders in the prompt
        return [[(prompt, "prompt"), (response, "output")] for response in responses]
    if not isinstance(prompt, list):
        raise RowError(
            f"'{cfg.prompt_column}' is a string beside responses of messages (TRL's forms: all strings, "
            "or a prompt of messages)"
        )
    messages = place_images(messages_with_images(prompt, f"'{cfg.prompt_column}'", cfg), count)
    messages = with_system(messages, system_prompt)
    head = images.render(messages, generation=True)
    out = []
    for name, response in zip(columns, responses):
        response = [{"role": "assistant", "content": response}] if isinstance(response, str) else response
        answer = place_images(messages_with_images(response, f"'{name}'", cfg), 0)
        if any(m["role"] != "assistant" for m in answer):
            raise RowError(f"'{name}' holds a message that is not the assistant's")
        whole = images.render(messages + answer)
        if not whole.startswith(head):
            raise RowError("the chat template writes the prompt differently once a response follows it")
        out.append([(head, "prompt"), (whole[len(head) :], "output")])
    return out


def side(images: ImageData, pieces: Pieces, pictures: list[Any]) -> ImageSide:
    """A side's pieces processed whole with the row's images (``ImageData.tokens``): the response's tokens learned."""
    ids, kinds, fields = images.tokens(pieces, pictures)
    return ids, [kind == "output" for kind in kinds], fields


class VisionPreferenceDataset(PreferenceDataset):
    """``PreferenceDataset`` for rows with images: each side's sample carries ``"images"``, its image fields."""

    reads_images = True

    def __init__(
        self,
        data: DataSection,
        images: ImageData,
        seq_len: int,
        system_prompt: str | None = None,
        on_long_pair: Literal["truncate", "drop"] = "truncate",
        dp_rank: int = 0,
        dp_world: int = 1,
    ) -> None:
        super().__init__(
            data, None, seq_len, None, system_prompt, on_long_pair, dp_rank, dp_world, tokenizer=images.tokenizer
        )
        self.images = images

    def _tokenize(self, item: Any, source: Source, row: int) -> tuple[list[int], ImageSide, ImageSide] | None:
        try:
            if not isinstance(item, dict):
                raise RowError(f"the row is {type(item).__name__}, not an object with columns")
            pictures = row_images(item, self.images.vision.images_column, source_folder(source))
            columns = (self.cfg.chosen_column, self.cfg.rejected_column)
            chosen_pieces, rejected_pieces = response_pieces(
                item, columns, len(pictures), self.cfg, self.images, self.system_prompt
            )
            chosen, rejected = (side(self.images, pieces, pictures) for pieces in (chosen_pieces, rejected_pieces))
        except RowError as e:
            self._bad_row(source, row, str(e), _FIX)
            return None
        n = next((t for t, learned in enumerate(chosen[1]) if learned), len(chosen[1]))  # (the prompt's tokens)
        if chosen[0][:n] != rejected[0][:n]:
            self._bad_row(source, row, "the prompt's tokens differ between the two sides", _FIX)
            return None
        return chosen[0][:n], chosen, rejected

    def _pair(
        self, prompt: list[int], chosen: ImageSide, rejected: ImageSide, source: int, row: int
    ) -> PreferencePair | None:
        """Each side's sample with its image fields; responses cut to ``seq_len`` (the prompt never is)."""
        n = len(prompt)
        too_long = max(len(chosen[0]), len(rejected[0])) > self.seq_len
        if too_long and (self.on_long_pair == "drop" or n >= self.seq_len):
            self.dropped += 1
            self.long_dropped += self.on_long_pair == "drop"
            return None
        samples = []
        for ids, learned, fields in (chosen, rejected):
            keep = min(len(ids), self.seq_len)
            response: Response = (ids[n:keep], learned[n:keep])
            sample = pair_sample(prompt, response)
            samples.append({**sample, "images": cut_fields(fields, keep, self.images.layout)})
        pair = PreferencePair(samples[0], samples[1], source, row)
        same = pair.chosen["tokens"] == pair.rejected["tokens"]
        if same or not (has_target(pair.chosen) and has_target(pair.rejected)):
            self.dropped += 1
            return None
        self.truncated += too_long
        return pair
