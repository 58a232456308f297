"""Per-rank streaming reads of a Hugging Face checkpoint: every rank reads only the parts of the safetensors it holds.

A 235B MoE checkpoint is 438 GiB of bf16; no rank can hold it, and one rank reading it for all is slow. Here
each rank walks its own parameters (plain tensors, or DTensors of any layout: FSDP, TP, EP, their strided
mixes) and reads from the memory-mapped files just the rows and columns of its shard (``SliceReader``):

- a renamed tensor: the box of its shard (``safe_open(...).get_slice``);
- a part of a fused tensor (Phi-3's ``qkv_proj``): the same rows, moved by the parts before it;
- RoPE-permuted rows (``wq``, ``wk``): the whole heads that hold the shard's rows, permuted, then cut;
- stacked experts stored transposed (Llama 4's ``gate_up_proj`` ``[E, H, 2I]``): the box of the shard, transposed;
- stacked experts: one HF tensor per expert, and only this rank's experts, each cut to its shard; where an
  expert's part of ours is several HF tensors one after the other (``transformers``' fused ``gate_up_proj``, from
  a checkpoint's ``gate_proj`` and ``up_proj``), the rows of the shard from each of them.

The adapter says where each tensor lies (``hf_source``, ``expert_templates``). Peak host memory per rank is its
shard plus one tensor's box, and no rank sends anything: the load needs no communication.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch.distributed.tensor import DTensor

from titanium.checkpoint.hf_quantized import Quantized
from titanium.models.hf_adapter import HFAdapter, RowSource, rope_rows_from_hf
from titanium.parallel.params import local_indices

Index = Sequence[torch.Tensor | None]
"""Per dimension, the positions to read (int64), or None for all of them."""


class SliceReader:
    """Reads tensors or parts of tensors from the safetensors files of one checkpoint, each file opened once.

    Failures are ``OSError``s that name the file (a truncated or corrupt shard). ``bytes_read`` counts the bytes of
    the boxes read so far.
    """

    def __init__(self, folder: Path, weight_map: Mapping[str, str], quantized: Quantized | None = None) -> None:
        """``quantized``: how a quantized checkpoint stores its weights (``hf_quantized``), read dequantized."""
        self._folder, self._weight_map, self._quantized = folder, weight_map, quantized
        self._stack = contextlib.ExitStack()
        self._files: dict[str, Any] = {}
        self.bytes_read = 0

    def __enter__(self) -> SliceReader:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._stack.close()

    def read(self, key: str, index: Index | None = None) -> torch.Tensor:
        """HF tensor ``key``, or the positions ``index`` of it: one read of the box from the first to the last
        position of each dimension, then the positions picked out of that box (only strided shards need this, and
        an FP8 weight's scales, read once per weight element). A quantized weight comes back dequantized."""
        if self._quantized is not None and key in self._quantized.parts:
            return self._quantized.read(key, index, self._read)
        return self._read(key, index)

    def _read(self, key: str, index: Index | None = None) -> torch.Tensor:
        path = self._folder / self._weight_map[key]
        try:
            file = self._file(path)
            whole = index is None or all(positions is None for positions in index)
            box = () if whole else tuple(_span(positions) for positions in index)
            value = file.get_tensor(key) if whole else file.get_slice(key)[box]
        except (SafetensorError, OSError) as e:
            raise OSError(f"{path}: {e}") from e
        self.bytes_read += value.numel() * value.element_size()
        if whole:
            return value
        for dim, (positions, span) in enumerate(zip(index, box, strict=True)):
            if positions is not None and not _is_range(positions, span):  # (a whole box may hold them out of order)
                value = value.index_select(dim, positions - span.start)
        return value

    def rows(self, key: str) -> int:
        """The rows of HF tensor ``key``, from its file's header."""
        path = self._folder / self._weight_map[key]
        try:
            return int(self._file(path).get_slice(key).get_shape()[0])
        except (SafetensorError, OSError) as e:
            raise OSError(f"{path}: {e}") from e

    def _file(self, path: Path) -> Any:
        if path.name not in self._files:
            self._files[path.name] = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
        return self._files[path.name]


def _is_range(positions: torch.Tensor, span: slice) -> bool:
    """Whether ``positions`` are every position of ``span``, in order."""
    return positions.numel() == span.stop - span.start and torch.equal(positions, torch.arange(span.start, span.stop))


def _span(positions: torch.Tensor | None) -> slice:
    """The slice from the first to the last of ``positions`` (all for None)."""
    if positions is None:
        return slice(None)
    if not positions.numel():
        return slice(0, 0)
    return slice(int(positions.min()), int(positions.max()) + 1)


def _local(target: torch.Tensor) -> torch.Tensor:
    return target.to_local() if isinstance(target, DTensor) else target


def read_rows(reader: SliceReader, source: RowSource, index: Index, rows: int) -> torch.Tensor:
    """Our tensor of ``rows`` rows at ``index`` from where ``source`` says it lies. RoPE-ordered rows are read in
    whole heads (the permutation stays within a head), put in our order, and the wanted rows picked out."""
    if not index:
        return reader.read(source.key)
    positions = torch.arange(rows) if index[0] is None else index[0]  # (a fused tensor has more rows than ours)
    head = source.rope_head_dim
    if head is None or not positions.numel():
        return reader.read(source.key, [positions + source.offset, *index[1:]])
    start, stop = int(positions.min()) // head * head, (int(positions.max()) // head + 1) * head
    block = reader.read(source.key, [torch.arange(start, stop) + source.offset, *index[1:]])
    return rope_rows_from_hf(block, head).index_select(0, positions - start)


def read_transposed(reader: SliceReader, source: RowSource, index: Index, rows: int) -> torch.Tensor:
    """Our stacked experts ``[E, rows, cols]`` at ``index`` from an HF tensor that holds them transposed
    (``RowSource.transposed``): the box of the shard's experts, columns and rows, swapped back."""
    experts, positions, columns = index
    positions = torch.arange(rows) if positions is None else positions
    return reader.read(source.key, [experts, columns, positions + source.offset]).transpose(1, 2)


def read_expert(reader: SliceReader, names: Sequence[str], index: Index) -> torch.Tensor:
    """One expert's part of ours at ``index`` (its dimensions after the expert's) from the HF tensors ``names``, whose
    rows one after the other make it: from each, the shard's rows that lie in it."""
    if len(names) == 1:
        return reader.read(names[0], index)
    ends = torch.tensor([reader.rows(name) for name in names]).cumsum(0).tolist()
    positions = torch.arange(ends[-1]) if not index or index[0] is None else index[0]
    pieces = []
    for name, start, end in zip(names, [0, *ends[:-1]], ends, strict=True):
        mine = (positions >= start) & (positions < end)
        pieces.append((mine, reader.read(name, [positions[mine] - start, *index[1:]])))
    out = pieces[0][1].new_empty((positions.numel(), *pieces[0][1].shape[1:]))
    for mine, piece in pieces:
        out[mine] = piece
    return out


@torch.no_grad()
def stream_into(targets: Mapping[str, torch.Tensor], reader: SliceReader, adapter: HFAdapter, args: Any) -> None:
    """Fill ``targets`` (ours -> plain tensor or DTensor, whose local shard is written) from ``reader``'s checkpoint,
    reading only what this rank holds. The values are those of ``adapter.from_hf`` on the whole checkpoint."""
    for key, target in targets.items():
        index = local_indices(target)
        local = _local(target)
        templates = adapter.expert_templates(key)
        if templates is None:
            source = adapter.hf_source(key, args)
            if source.transposed:
                local.copy_(read_transposed(reader, source, index, target.shape[1]))
            else:
                local.copy_(read_rows(reader, source, index, target.shape[0] if index else 0))
            continue
        experts = range(target.shape[0]) if index[0] is None else index[0].tolist()
        for row, expert in enumerate(experts):
            names = [template.format(e=expert) for template in templates]
            local[row].copy_(read_expert(reader, names, index[1:]))
