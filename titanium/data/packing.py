"""Fine-tuning samples -> training rows: packed several to a seq_len row, or one per row padded (``padded_rows``).

Every row carries, besides ``input`` and ``label``, the ``positions`` (restarting at 0 per sample)
and ``document_ids`` (0, 1, 2... per sample in the row) that let attention stay within a sample, so
a sample's loss does not depend on what it was packed with. Padding forms a document of its own, so
its queries still see a key (no fully masked attention rows, hence no NaN) and touch no real sample.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, Protocol

import torch

from titanium.data.sft import IGNORE_INDEX, Sample

logger = logging.getLogger("titanium")

Batch = dict[str, torch.Tensor]


class SampleStream(Protocol):
    """A resumable iterable of {"tokens", "labels"} samples (titanium.data.sft.SFTDataset)."""

    def __iter__(self) -> Iterator[Sample]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


PadTo = Literal["seq_len", "longest"]
"""How wide a batch's rows are: always seq_len (fixed shapes, e.g. for pipeline parallelism), or the batch's
longest row rounded up to a bucket (``bucket_width``), so short rows do not pay for seq_len."""


def row_width(
    pad_to: str, pad_multiple: int, fixed_shapes: bool, sequence_multiple: int, option: str
) -> tuple[PadTo, int]:
    """A ``pad_to`` option (``auto``, ``longest`` or ``seq_len``; ``option``: its name, e.g. ``--dpo.pad_to``) and
    ``pad_multiple`` as the layout allows: fixed-width rows when the layout needs ``fixed_shapes`` (pipeline
    parallelism: ``auto`` says so quietly, ``longest`` with a warning), else widths that the context- and
    tensor-parallel sequence split (``sequence_multiple``) divides."""
    if fixed_shapes:
        if pad_to == "longest":
            logger.warning(f"{option} longest: pipeline parallelism needs fixed shapes; rows keep a fixed width")
        return "seq_len", pad_multiple
    return ("seq_len" if pad_to == "seq_len" else "longest"), math.lcm(pad_multiple, sequence_multiple)


def bucket_width(longest: int, seq_len: int, pad_multiple: int = 8) -> int:
    """The row width for a batch whose longest row has ``longest`` tokens: rounded up to a bucket, at most seq_len.

    Buckets are quarter octaves: a length in (2^k, 2^(k+1)] rounds up to a multiple of 2^(k-2) (and of
    ``pad_multiple``), e.g. 36 -> 40, 600 -> 640, 1100 -> 1280. So padding past the longest row is at most a
    quarter of it (plus the ``pad_multiple`` rounding of short rows), and a run sees at most four widths per
    doubling of length (28 up to 2048 with the default): torch.compile, which specializes on shapes, compiles
    a handful of graphs instead of one per step. ``pad_multiple`` is what every width must divide by: 8 suits
    tensor cores; under tensor (sequence) or context parallelism it must also be a multiple of the tp degree
    and of 2 x cp. ``seq_len`` itself (already divisible by those) is the cap, whatever the bucket.
    """
    if longest > seq_len or pad_multiple < 1:
        raise ValueError(f"no width for a row of {longest} tokens at seq_len {seq_len}, pad_multiple {pad_multiple}")
    step = math.lcm(pad_multiple, 1 << max((longest - 1).bit_length() - 3, 0))
    return min(seq_len, -(-longest // step) * step)


def make_row(samples: Iterable[Sample], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Concatenate samples (at most seq_len tokens in all) and right-pad to seq_len."""
    tokens: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    documents: list[int] = []
    n_docs = 0
    for n_docs, sample in enumerate(samples, start=1):
        n = len(sample["tokens"])
        tokens += sample["tokens"]
        labels += sample["labels"]
        positions += range(n)
        documents += [n_docs - 1] * n
    pad = seq_len - len(tokens)
    if pad < 0:
        raise ValueError(f"samples of {len(tokens)} tokens do not fit a row of {seq_len}")
    tokens += [pad_id] * pad
    labels += [IGNORE_INDEX] * pad
    positions += range(pad)
    documents += [n_docs] * pad
    return {
        "input": torch.tensor(tokens, dtype=torch.long),
        "label": torch.tensor(labels, dtype=torch.long),
        "positions": torch.tensor(positions, dtype=torch.long),
        "document_ids": torch.tensor(documents, dtype=torch.long),
    }


def padding_mask(rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """Which positions of rows made by `make_row` (any leading batch shape) are padding, by structure not id.

    Padding is a row's last document when that document learns nothing: every real sample has a learned
    label (SFTDataset drops the others). The pad id cannot tell, as it is often EOS standing in for a
    missing pad token, and every real sample may end with EOS too.
    """
    last_document = rows["document_ids"] == rows["document_ids"][..., -1:]
    learns = ((rows["label"] != IGNORE_INDEX) & last_document).any(dim=-1, keepdim=True)
    return last_document & ~learns


def _check_length(sample: Sample, seq_len: int) -> Sample:
    if len(sample["tokens"]) > seq_len:  # SFTDataset cuts or drops these; anything else is our bug
        raise ValueError(f"a sample of {len(sample['tokens'])} tokens is longer than seq_len={seq_len}")
    return sample


def padded_rows(samples: list[Sample], seq_len: int, pad_id: int, pad_to: PadTo, pad_multiple: int = 8) -> Batch:
    """One row per sample (``make_row``), stacked: seq_len wide, or with ``pad_to="longest"`` as wide as the longest
    sample rounded up by ``bucket_width``. Causal attention never lets a token see the padding after it, so either
    width gives every real token the same logits; short samples just stop paying for seq_len."""
    width = seq_len
    if pad_to == "longest":
        width = bucket_width(max(len(_check_length(s, seq_len)["tokens"]) for s in samples), seq_len, pad_multiple)
    made = [make_row([_check_length(s, seq_len)], width, pad_id) for s in samples]
    return {key: torch.stack([m[key] for m in made]) for key in made[0]}


class PackedDataset:
    """Rows of exactly seq_len tokens, each holding whole samples, filled best-fit from a bounded buffer.

    A row starts with the oldest buffered sample, so no sample waits more than ``buffer_size`` rows
    and the data order is roughly kept; the space left is then filled, largest-that-fits first, from
    the other buffered samples. The buffer is topped up from the stream after every pick. The state
    is the stream's position plus the buffered samples, so a resumed run packs the very same rows.

    ``row_of`` makes a row of the picked samples (``make_row``; an image-text model's samples keep their images:
    ``titanium.data.vision.packed_image_row``).
    """

    def __init__(
        self,
        samples: SampleStream,
        seq_len: int,
        pad_id: int,
        buffer_size: int,
        row_of: Callable[[list[Sample], int, int], dict[str, Any]] = make_row,
    ) -> None:
        if buffer_size < 1:
            raise ValueError(f"--sft.pack_buffer must be >= 1, got {buffer_size}")
        self.samples, self.seq_len, self.pad_id, self.buffer_size = samples, seq_len, pad_id, buffer_size
        self.row_of = row_of
        self.buffer: list[Sample] = []  # oldest first

    def _fill(self, stream: Iterator[Sample]) -> None:
        while len(self.buffer) < self.buffer_size:
            sample = next(stream, None)
            if sample is None:
                return
            self.buffer.append(_check_length(sample, self.seq_len))

    def _best_fit(self, space: int) -> Sample | None:
        """Remove and return the longest buffered sample of at most `space` tokens (the oldest among equals)."""
        best = None
        for k, sample in enumerate(self.buffer):
            n = len(sample["tokens"])
            if n <= space and (best is None or n > len(self.buffer[best]["tokens"])):
                best = k
        return None if best is None else self.buffer.pop(best)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        stream = iter(self.samples)
        while True:
            self._fill(stream)
            if not self.buffer:
                return  # only a finite stream ends
            row = [self.buffer.pop(0)]
            space = self.seq_len - len(row[0]["tokens"])
            while space > 0:
                self._fill(stream)
                sample = self._best_fit(space)
                if sample is None:
                    break
                row.append(sample)
                space -= len(sample["tokens"])
            yield self.row_of(row, self.seq_len, self.pad_id)

    def state_dict(self) -> dict[str, Any]:
        # One JSON string, not nested lists: DCP flattens nested containers into keys, and a buffer whose
        # length changes between save and load would then not match the structure it loads into.
        buffer = [_sample_json(s) for s in self.buffer]
        return {"samples": self.samples.state_dict(), "buffer": json.dumps(buffer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples.load_state_dict(state["samples"])
        self.buffer = [_json_sample(s) for s in json.loads(state["buffer"])]


def _sample_json(sample: Sample) -> dict[str, Any]:
    """A buffered sample as JSON: its tokens and labels, and an image-text sample's ``images`` (the processor's
    tensors, which the buffer must keep with their sample) as ``torch.save`` bytes in base64."""
    out: dict[str, Any] = {"tokens": list(sample["tokens"]), "labels": list(sample["labels"])}
    if sample.get("images") is not None:
        data = io.BytesIO()
        torch.save(dict(sample["images"]), data)
        out["images"] = base64.b64encode(data.getvalue()).decode("ascii")
    return out


def _json_sample(value: dict[str, Any]) -> Sample:
    sample: dict[str, Any] = {"tokens": list(value["tokens"]), "labels": list(value["labels"])}
    if "images" in value:
        sample["images"] = torch.load(io.BytesIO(base64.b64decode(value["images"])), weights_only=True)
    return sample
