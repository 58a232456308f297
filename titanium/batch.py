"""The typed microbatch: a core the loop owns, plus a dataclass of the objective's own fields.

The core is what every objective has and what the loop, context parallelism and the pipeline act on: the token
ids the model reads ``[rows, seq]``, their positions and document ids (packed rows; None: one document per row
at positions 0..seq-1), the row count, and the number of loss units, which the fields say (``Fields.units``:
labelled tokens, pairs, responses). The objective's own tensors (labels, reference log-probs, advantages) live
in its fields dataclass, each declared with how it lines up with the core, so that no layout needs to know the
objective:

- ``per_token()``: ``[rows, seq, ...]``; context parallelism keeps this rank's part of the sequence, a pipeline
  microbatch its rows (labels, response ids, reference log-probs);
- ``per_row()``: ``[rows, ...]``; a pipeline microbatch keeps its rows (advantages, pairs per row);
- a plain field: kept whole (a flat index, a setting).

Rows of an image-text model may carry images (``ImageInputs``): what the model's processor made of each row's images,
padded to the microbatch's largest row; a pipeline microbatch keeps its rows' images, and a sequence is never split
with them (context parallelism refuses image batches).

Metrics never travel in a batch: an objective returns them from ``prepare`` and ``loss``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

_ALIGN = "titanium.batch.align"


def per_token(**kwargs: Any) -> Any:
    """A fields-dataclass field shaped ``[rows, seq, ...]`` like the tokens (``dataclasses.field`` kwargs)."""
    return field(metadata={_ALIGN: "token"}, **kwargs)


def per_row(**kwargs: Any) -> Any:
    """A fields-dataclass field shaped ``[rows, ...]``: one entry per row of the batch."""
    return field(metadata={_ALIGN: "row"}, **kwargs)


@dataclass
class Fields:
    """Base of an objective's fields (a dataclass): its own tensors, and how many loss units they hold."""

    def units(self) -> torch.Tensor:
        """Loss units of this (part of a) batch as an integer tensor, known before the forward: the loop adds
        them over the step's microbatches and the ranks and divides the loss sum by the total."""
        raise NotImplementedError(f"{type(self).__name__} holds no loss units")


Metrics = dict[str, tuple[torch.Tensor, torch.Tensor]]
"""name -> (sum, count) over a microbatch's (or a step's) units, as device tensors; shown as sum / count after the
loop adds them over microbatches and ranks (e.g. ``"dpo/accuracy": (correct pairs, pairs)``)."""

F = TypeVar("F", bound=Fields)
Map = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class ImageInputs:
    """The images of a microbatch's rows, as the model's processor prepared them (``pixel_values``, and per model
    ``image_grid_thw``, ``aspect_ratio_ids``, ``cross_attention_mask``, ``token_type_ids``...), one entry per row.

    Each field is ``[rows, ...]``: a per-token field (``token_type_ids``) is ``[rows, seq, ...]`` like the tokens; any
    other holds each row's entries (its images, tiles or patches) along dim 1, padded with zeros to the largest row.
    ``counts`` says how many of a row's entries are real, so ``whole`` gives the layout the processor gives a batch
    of these rows (every real entry, in row order)."""

    fields: dict[str, torch.Tensor]
    counts: dict[str, torch.Tensor] = field(default_factory=dict)
    """name -> ``[rows]``: the real entries of each row's field (fields not per token)."""

    @property
    def rows(self) -> int:
        return next(iter(self.fields.values())).shape[0]

    def whole(self, name: str) -> torch.Tensor:
        """The real entries of every row of field ``name``, concatenated in row order."""
        value, counts = self.fields[name], self.counts[name]
        keep = torch.arange(value.shape[1], device=value.device)[None, :] < counts.to(value.device)[:, None]
        return value[keep]

    def per_token(self) -> list[str]:
        """The per-token fields' names (those without ``counts``)."""
        return [name for name in self.fields if name not in self.counts]

    def map(self, fn: Map) -> ImageInputs:
        """``fn`` applied to every field and count (a selection of rows, a move to a device)."""
        return ImageInputs({k: fn(v) for k, v in self.fields.items()}, {k: fn(v) for k, v in self.counts.items()})


@dataclass
class Batch(Generic[F]):
    """One microbatch of one data-parallel rank."""

    tokens: torch.Tensor
    """``[rows, seq]`` token ids the model reads."""
    fields: F
    """The objective's own tensors."""
    positions: torch.Tensor | None = None
    """``[rows, seq]`` positions of the tokens (packed samples restart them; context parallelism: global ones)."""
    document_ids: torch.Tensor | None = None
    """``[rows, seq]`` the sample each token belongs to: attention stays inside it."""
    parent_ids: torch.Tensor | None = None
    """``[rows, seq]`` with ``document_ids``: the document whose earlier positions a token's document continues
    (a prompt shared by two responses; the token's own document where there is none)."""
    images: ImageInputs | None = None
    """The rows' images (an image-text model's batches); None: text only."""

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    def units(self) -> torch.Tensor:
        return self.fields.units()

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments of the model's forward."""
        inputs = {"tokens": self.tokens}
        if self.positions is not None:
            inputs["positions"] = self.positions
        if self.document_ids is not None:
            inputs["document_ids"] = self.document_ids
        if self.parent_ids is not None:
            inputs["parent_ids"] = self.parent_ids
        if self.images is not None:
            inputs["images"] = self.images
        return inputs

    def split_sequence(self, index: torch.Tensor) -> Batch[F]:
        """The positions ``index`` of every sequence (context parallelism), with their global positions."""
        if self.images is not None:
            raise ValueError("a batch with images cannot be split along the sequence (context parallelism)")
        part = self._map(lambda t: t[:, index], token=True, row=False, rest=False)
        if part.positions is None:  # one document per row: the global positions are the indices
            part.positions = index.expand(self.rows, -1)
        return part

    def select_rows(self, rows: torch.Tensor) -> Batch[F]:
        """The rows ``rows`` (a pipeline microbatch), with every field the objective put in the batch."""
        return self._map(lambda t: t[rows], token=True, row=True, rest=False)

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch[F]:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking), token=True, row=True, rest=True)

    def _map(self, fn: Map, *, token: bool, row: bool, rest: bool) -> Batch[F]:
        """``fn`` applied to the core and to the fields of the alignments asked for."""
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(self.fields):
            value = getattr(self.fields, f.name)
            align = f.metadata.get(_ALIGN)
            wanted = token if align == "token" else row if align == "row" else rest
            if wanted and isinstance(value, torch.Tensor):
                changes[f.name] = fn(value)
        fields = dataclasses.replace(self.fields, **changes) if changes else self.fields
        core = (self.positions, self.document_ids, self.parent_ids)
        positions, documents, parents = (fn(t) if t is not None else None for t in core)
        images = self.images.map(fn) if self.images is not None and row else self.images
        return Batch(fn(self.tokens), fields, positions, documents, parents, images)


def empty_batch() -> Batch[Fields]:
    """A microbatch with no rows yet, for objectives that make their rows in ``prepare`` (rollouts)."""
    return Batch(torch.empty(0, 0, dtype=torch.long), Fields())


class Placement:
    """Where a microbatch runs: on ``device``, its sequences whole. Under context parallelism the loop hands
    objectives a subclass (titanium.parallel.context) whose ranks each hold a part of every sequence."""

    parts = 1
    """How many ranks share every sequence, each holding a part of it."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")

    @property
    def split(self) -> bool:
        """True when each rank holds only a part of every sequence."""
        return self.parts > 1

    def place(self, batch: Batch[F]) -> Batch[F]:
        """This rank's part of ``batch`` (a CPU microbatch as the data pipeline made it), on the device."""
        return batch.to(self.device, non_blocking=True)

    def add_parts(self, values: torch.Tensor) -> torch.Tensor:
        """Sums over each sequence (e.g. a response's log-prob) completed from every rank's part of it, with
        their gradient (a loss non-linear in such a sum needs the whole sum first)."""
        return values

    def whole_sequences(self, values: torch.Tensor) -> torch.Tensor:
        """``[rows, part, ...]`` values of this rank's part of every sequence (e.g. hidden states) completed to
        ``[rows, parts x part, ...]`` in sequence order from every rank's part, with their gradient."""
        return values
