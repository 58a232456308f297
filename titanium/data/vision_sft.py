"""Fine-tuning samples of an image-text model: rows with images -> tokens, shifted labels and the row's image tensors.

``SFTDataset``'s stream, position, counters and long-sample rules, with rows read as TRL reads vision data
(``titanium.data.vision``): a conversation (``messages`` with image parts, or its images placed before the first
user message's text) or TRL's conversational prompt/completion row, through the model's processor. A sample too
long for ``seq_len`` is cut only after its last image token (the image features must all find their placeholders),
else dropped and counted; ``--sft.on_long_sample drop`` drops every long one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from titanium.config.sections import DataSection, SFTSection
from titanium.data.chat import RowError
from titanium.data.completion import is_prompt_completion
from titanium.data.sft import IGNORE_INDEX, ROW_FIX, SFTDataset, shifted_labels
from titanium.data.text import DataError, Source
from titanium.data.vision import ImageData, cut_fields, messages_with_images, place_images, row_images

IMAGE_FIX = (
    "fix the row (its images, and as many image parts in its messages as images, or none), or point "
    "--vision.images_column and --data.messages_column at its columns"
)


def with_system(messages: list[dict[str, Any]], system_prompt: str | None) -> list[dict[str, Any]]:
    """``messages`` with ``system_prompt`` as their system message (replacing one), as ``[chat] system_prompt`` says
    for text rows."""
    if system_prompt is None:
        return messages
    rest = messages[1:] if messages and messages[0]["role"] == "system" else messages
    return [{"role": "system", "content": [{"type": "text", "text": system_prompt}]}, *rest]


def source_folder(source: Source) -> Path | None:
    """The folder of a local data file (relative image paths are read from there); None for a hub dataset."""
    return Path(source.data_files).parent if source.data_files is not None else None


class VisionSFTDataset(SFTDataset):
    """``SFTDataset`` for rows with images: samples are ``{"tokens", "labels", "images"}`` (module docstring)."""

    reads_images = True

    def __init__(
        self,
        data: DataSection,
        sft: SFTSection,
        images: ImageData,
        seq_len: int,
        dp_rank: int = 0,
        dp_world: int = 1,
        system_prompt: str | None = None,
    ) -> None:
        if data.kind != "chat":
            raise DataError(f"--data.kind {data.kind}: an image-text model reads conversations with images (kind chat)")
        super().__init__(data, sft, images.tokenizer, None, seq_len, dp_rank, dp_world, system_prompt)
        self.images = images

    def _conversation(self, item: Any, source: Source) -> tuple[list[int], list[bool], dict[str, Any]]:
        """The row's ids, which carry loss, and its image fields."""
        if not isinstance(item, dict):
            raise RowError(f"the row is {type(item).__name__}, not an object with columns")
        pictures = row_images(item, self.images.vision.images_column, source_folder(source))
        render = self.images.render
        if is_prompt_completion(item, self.cfg):
            prompt = item.get(self.cfg.prompt_column)
            if not isinstance(prompt, list) or not isinstance(item[self.cfg.completion_column], list):
                raise RowError("a prompt/completion row with images holds messages (TRL's conversational form)")
            prompt = place_images(messages_with_images(prompt, f"'{self.cfg.prompt_column}'", self.cfg), len(pictures))
            prompt = with_system(prompt, self.system_prompt)
            completion = place_images(
                messages_with_images(item[self.cfg.completion_column], f"'{self.cfg.completion_column}'", self.cfg), 0
            )
            head = render(prompt, generation=True)
            whole = render(prompt + completion)
            if not whole.startswith(head):
                raise RowError("the chat template writes the prompt differently once the completion follows it")
            pieces = [(head, "prompt"), (whole[len(head) :], "output")]
        else:
            column = self.cfg.messages_column
            if item.get(column) is None:
                raise RowError(f"no '{column}' column (columns: {sorted(item)})")
            messages = place_images(messages_with_images(item[column], f"'{column}'", self.cfg), len(pictures))
            messages = with_system(messages, self.system_prompt)
            if messages[-1]["role"] != "assistant":
                raise RowError(f"the conversation ends with a {messages[-1]['role']} message, not an assistant answer")
            pieces = self.images.pieces(messages)
        ids, kinds, fields = self.images.tokens(pieces, pictures)
        return ids, self.images.learned(kinds, self.sft.train_on_input), fields

    def _image_sample(self, item: Any, source: Source, row: int) -> dict[str, Any] | None:
        try:
            ids, trainable, fields = self._conversation(item, source)
        except RowError as e:
            self._bad_row(source, row, str(e), f"{IMAGE_FIX}; {ROW_FIX['chat']}")
            return None
        n = len(ids)
        if n > self.seq_len:
            last_image = max((i for i, t in enumerate(ids) if t in self.images.image_token_ids), default=-1)
            if self.sft.on_long_sample == "drop" or last_image >= self.seq_len:
                self.dropped += 1
                why = "its image tokens end after it" if last_image >= self.seq_len else "--sft.on_long_sample drop"
                self._warn_once(
                    "dropped",
                    source,
                    row,
                    f"a sample of {n} tokens is longer than --training.seq_len {self.seq_len}; dropped ({why})",
                )
                return None
            self.truncated += 1
            self._warn_once(
                "truncated",
                source,
                row,
                f"a sample of {n} tokens is longer than --training.seq_len "
                f"{self.seq_len}; cut to {self.seq_len} tokens after its last image",
            )
            ids, trainable = ids[: self.seq_len], trainable[: self.seq_len]
            fields = cut_fields(fields, self.seq_len, self.images.layout)
        labels = shifted_labels(ids, trainable)
        if all(label == IGNORE_INDEX for label in labels):
            self.dropped += 1
            self._warn_once("dropped", source, row, "nothing to learn within --training.seq_len; dropped")
            return None
        return {"tokens": ids, "labels": labels, "images": fields}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for source, row, item in self._rows():
            sample = self._image_sample(item, source, row)
            if sample is not None:
                self._pass_used = True
                yield sample


def image_prompt(
    item: Any, source: Source, data: DataSection, images: ImageData, system_prompt: str | None = None
) -> tuple[list[int], dict[str, Any], str]:
    """A held-out conversation with images as a prompt to answer: the ids of every message before the last with the
    assistant header after them, the prompt's image fields, and the last (assistant) message's text, the answer to
    match. ``RowError`` for a row that is not such a conversation."""
    if not isinstance(item, dict) or item.get(data.messages_column) is None:
        raise RowError(f"no '{data.messages_column}' column")
    pictures = row_images(item, images.vision.images_column, source_folder(source))
    messages = messages_with_images(item[data.messages_column], f"'{data.messages_column}'", data)
    messages = with_system(place_images(messages, len(pictures)), system_prompt)
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
        raise RowError("the conversation does not end with an assistant answer after a prompt")
    answer = messages[-1]["content"]
    if not isinstance(answer, str):
        answer = "".join(part.get("text", "") for part in answer)
    ids, _, fields = images.tokens([(images.render(messages[:-1], generation=True), "prompt")], pictures)
    return ids, fields, answer
