"""Unpaired preference data (KTO): rows -> one prompt, one completion and whether it is desirable -> samples.

Rows are TRL's unpaired format (column names per --data.prompt_column, completion_column, label_column):
``{"prompt": ..., "completion": ..., "label": true | false}``, with ``prompt`` a string (one user message) or a
list of messages, and ``completion`` a string (the assistant's answer) or the answer's messages. Each row is
rendered by the chat template as prompt + completion, as one side of a preference pair is
(titanium.data.preference), and only the completion's tokens carry labels. A row whose label is missing or not
a JSON boolean is a bad row: skipped and counted (the first few logged with file and row), or an error with
``--data.on_bad_row fail``.

A microbatch of B examples also carries KTO's **mismatched** rows, from which the KL reference point is
estimated: example i's prompt followed by example i - 1's completion (example 0 takes the last one's), TRL's
rotation of the completions by one within each per-device batch. A mismatched row longer than seq_len keeps
its start (the completion is cut from its end), as TRL's collator truncates.

An image-text model's examples (titanium.data.vision_unpaired) carry their image fields; a mismatched row reads its
prompt's images (``with_text_after``: the same pixel values, the per-token fields over the other completion as the
processor gives them to text after the prompt), as TRL's ``DataCollatorForVisionUnpairedPreference`` pairs them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from titanium.batch import ImageInputs
from titanium.config.sections import DataSection
from titanium.data.chat import ChatTemplate, Message, RowError, check_conversation, with_system_prompt
from titanium.data.packing import PadTo, padded_rows
from titanium.data.preference import (
    Response,
    _messages,
    _response,
    fit_pair,
    has_target,
    pair_sample,
    tokenize_response,
)
from titanium.data.text import DataError, RowReader, Source
from titanium.data.vision import FIELD, ProcessorLayout, image_rows, with_text_after

UNPAIRED_FIX = (
    "fix the row, or point --data.prompt_column, --data.completion_column and --data.label_column at its columns "
    "(label: true for a desirable completion, false for an undesirable one)"
)


@dataclass
class UnpairedExample:
    """One example fitted to seq_len: prompt ids, the completion's ids and loss mask, and its label."""

    prompt: list[int]
    completion: Response
    desirable: bool
    source: int
    row: int
    images: dict[str, torch.Tensor] | None = None
    """An image-text model's example: the image fields of prompt + completion (``titanium.data.vision``)."""


def row_label(row: Any, cfg: DataSection) -> bool:
    """Whether the row's completion is desirable (``--data.label_column``, a JSON boolean)."""
    if not isinstance(row, dict):
        raise RowError(f"the row is {type(row).__name__}, not an object with columns")
    label = row.get(cfg.label_column)
    if cfg.label_column not in row:
        raise RowError(f"no '{cfg.label_column}' column (columns: {sorted(row)})")
    if not isinstance(label, bool):
        shown = "null" if label is None else f"{type(label).__name__} {label!r}"
        raise RowError(f"'{cfg.label_column}' is {shown}, not true or false")
    return label


def parse_unpaired_row(row: Any, cfg: DataSection) -> tuple[list[Message], list[Message], bool]:
    """(prompt, completion, desirable) of a row; the completion starts with the assistant."""
    label = row_label(row, cfg)
    prompt = _messages(row, cfg.prompt_column, "user", cfg)
    if prompt is None:
        raise RowError(f"no '{cfg.prompt_column}' column (columns: {sorted(row)})")
    completion = _response(row, cfg.completion_column, cfg)
    if completion[0].role != "assistant":
        raise RowError(f"'{cfg.completion_column}' starts with a {completion[0].role} message, not the assistant's")
    check_conversation(prompt + completion)
    return prompt, completion, label


class UnpairedDataset(RowReader):
    """Infinite, resumable stream of UnpairedExamples (prompt + completion at most seq_len tokens) for one DP rank.

    Counters (kept in the state): ``bad_rows`` (skipped), ``truncated`` (cut to fit seq_len: the prompt's start
    first, keeping at least half of seq_len, then the completion's end), ``dropped`` (nothing left to learn).
    """

    def __init__(
        self,
        data: DataSection,
        template: ChatTemplate,
        seq_len: int,
        bos_id: int | None,
        system_prompt: str | None = None,
        dp_rank: int = 0,
        dp_world: int = 1,
    ) -> None:
        if data.kind != "unpaired":
            raise DataError(f"--data.kind {data.kind} has no labelled completions; use --data.kind unpaired")
        super().__init__(data, dp_rank, dp_world)
        self.template, self.seq_len, self.bos_id, self.system_prompt = template, seq_len, bos_id, system_prompt
        self.truncated = 0
        self.dropped = 0

    def _example(self, item: Any, source: Source, row: int) -> UnpairedExample | None:
        try:
            prompt, completion, desirable = parse_unpaired_row(item, self.cfg)
            prompt = with_system_prompt(prompt, self.system_prompt)
            prompt_ids = self.template.prompt(prompt)
            response = tokenize_response(self.template, prompt, prompt_ids, completion)
        except RowError as e:
            self._bad_row(source, row, str(e), UNPAIRED_FIX)
            return None
        too_long = len(prompt_ids) + len(response[0]) > self.seq_len
        prompt_ids, response, _ = fit_pair(prompt_ids, response, response, self.seq_len, self.bos_id)
        if not has_target(pair_sample(prompt_ids, response)):
            self.dropped += 1
            return None
        self.truncated += too_long
        return UnpairedExample(prompt_ids, response, desirable, self.source_idx, row)

    def __iter__(self) -> Iterator[UnpairedExample]:
        for source, row, item in self._rows():
            example = self._example(item, source, row)
            if example is not None:
                self._pass_used = True
                yield example

    def _unused_rows(self) -> list[str]:
        reasons = super()._unused_rows()
        if self.dropped:
            reasons.append(
                f"{self.dropped} examples left without a completion token once cut to --training.seq_len "
                f"{self.seq_len}: raise it"
            )
        return reasons

    def state_dict(self) -> dict[str, Any]:
        return {**self._position(), "truncated": self.truncated, "dropped": self.dropped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_position(state)
        self.truncated, self.dropped = state["truncated"], state["dropped"]


def mismatched(examples: list[UnpairedExample], seq_len: int) -> list[dict[str, list[int]]]:
    """KTO's mismatched samples: example i's prompt with example i - 1's completion (0 takes the last one's),
    the completion cut from its end to fit seq_len."""
    samples = []
    for i, example in enumerate(examples):
        ids, mask = examples[i - 1].completion
        room = seq_len - len(example.prompt)
        samples.append(pair_sample(example.prompt, (ids[:room], mask[:room])))
    return samples


KL = "kl_"
"""The prefix of the mismatched rows' entries in an unpaired batch."""


def unpaired_batch(
    examples: list[UnpairedExample],
    seq_len: int,
    pad_id: int,
    pad_to: PadTo = "seq_len",
    pad_multiple: int = 8,
    layout: ProcessorLayout | None = None,
) -> dict[str, torch.Tensor]:
    """One row per example (``input``, ``label``, ``positions``, ``document_ids`` as titanium.data.packing.make_row
    makes them, right-padded), ``desirable`` [B] bool, and the mismatched rows under ``kl_input`` and ``kl_label``.
    Rows are seq_len wide, or with ``pad_to="longest"`` as wide as the longest rounded up by ``bucket_width``
    (each set of rows on its own). With an image-text model's processor ``layout``, the examples' image fields
    (``image_rows``), and the mismatched rows' per-token ones under ``kl_`` (their other fields are the examples')."""
    batch = padded_rows([pair_sample(e.prompt, e.completion) for e in examples], seq_len, pad_id, pad_to, pad_multiple)
    kl_samples = mismatched(examples, seq_len)
    kl = padded_rows(kl_samples, seq_len, pad_id, pad_to, pad_multiple)
    batch["kl_input"], batch["kl_label"] = kl["input"], kl["label"]
    batch["desirable"] = torch.tensor([e.desirable for e in examples], dtype=torch.bool)
    if layout is not None:
        batch.update(image_rows([{"images": e.images} for e in examples], batch["input"].shape[1], layout))
        kl_images = [
            {"images": with_text_after(e.images, len(e.prompt), len(s["tokens"]), layout) if e.images else None}
            for e, s in zip(examples, kl_samples)
        ]
        kl_fields = image_rows(kl_images, kl["input"].shape[1], layout)
        batch.update(
            {KL + name: value for name, value in kl_fields.items() if name.removeprefix(FIELD) in layout.token}
        )
    return batch


def mismatched_images(rows: dict[str, torch.Tensor], images: ImageInputs | None) -> ImageInputs | None:
    """The mismatched rows' images in a batch of ``unpaired_batch``: the examples' ``images`` with the mismatched
    rows' own per-token fields."""
    if images is None:
        return None
    own = {name: rows[KL + FIELD + name] for name in images.per_token()}
    return ImageInputs({**images.fields, **own}, images.counts)


class UnpairedBatchLoader:
    """Microbatches of ``batch_size`` examples (``unpaired_batch``) from an infinite example stream;
    checkpointable (the stream's position: every example read has been handed out)."""

    def __init__(
        self,
        examples: UnpairedDataset,
        batch_size: int,
        seq_len: int,
        pad_id: int,
        pad_to: PadTo = "seq_len",
        pad_multiple: int = 8,
        layout: ProcessorLayout | None = None,
    ) -> None:
        self.examples, self.batch_size, self.seq_len, self.pad_id = examples, batch_size, seq_len, pad_id
        self.pad_to, self.pad_multiple, self.layout = pad_to, pad_multiple, layout
        self._stream: Iterator[UnpairedExample] | None = None

    def __iter__(self) -> UnpairedBatchLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._stream is None:
            self._stream = iter(self.examples)
        examples = [next(self._stream) for _ in range(self.batch_size)]
        return unpaired_batch(examples, self.seq_len, self.pad_id, self.pad_to, self.pad_multiple, self.layout)

    def state_dict(self) -> dict[str, Any]:
        return {"examples": self.examples.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.examples.load_state_dict(state["examples"])
        self._stream = None  # restart the generator from the restored position
