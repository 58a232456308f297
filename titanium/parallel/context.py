"""Context parallelism: each sequence is split over the cp ranks; attention gathers keys and values.

Every rank keeps its queries and gathers K/V of the whole sequence (all-gather-KV). The gather is
``all_gather_tensor_autograd``, whose backward is a reduce-scatter, so dK/dV come back to their owners
on any backend (``torch.distributed.nn.functional.all_gather`` returns wrong gradients on gloo when the
incoming gradient is not contiguous). With causal attention the later chunks of a sequence do more work,
so the sequence is cut into 2 x cp chunks and rank r keeps chunks r and 2cp-1-r (head-tail balancing).
RoPE and the causal mask use the tokens' global positions, which travel with the batch.

Attention computes no fully masked block, so its FLOPs are those of causal attention and balanced
over the ranks: once per forward (not per layer) the decoder gathers positions and document ids and
builds the masks of its two query chunks. With the dense (SDPA) kernel each chunk attends only to
the keys up to its own end (chunk j of 2cp sees (j + 1) / 2cp of the sequence); with FlexAttention one
block mask over the gathered keys skips the masked blocks. Visible keys never lie after their query
in the row (packed documents are contiguous and causal, and a shared prompt, a parent document, precedes
its responses), which is what makes the key limit exact. (The padding of a shared-prompt row wider than
seq_len, whose positions start again, loses the keys it would see after it: no label is learned from it.)

Sliding-window layers get masks of their own (the window only hides more keys, so the key limits hold).

The model knows nothing of this: ``apply_context_parallel`` swaps the class of each attention module
for a subclass whose ``attend`` gathers K/V, and the decoder's for one whose ``prepare_attention``
gathers positions; the parameter names do not change. A transformers backend model, whose attention is
one function (``titanium.models.transformers.attention``), is handed the ``SequenceSplitter`` instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.nn.functional import all_reduce as all_reduce_with_grad
from torch.nn.attention.flex_attention import BlockMask

from titanium.batch import Batch, F, Placement
from titanium.models.common.attention import Attention, AttentionInputs, document_causal_mask
from titanium.models.common.attention_kernels import (
    PLAIN_SCORES,
    AttentionBackend,
    Scores,
    document_block_mask,
    flex,
    masked_kernel,
    sdpa,
)
from titanium.models.common.decoder import Decoder


def headtail_indices(seq_len: int, cp_size: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Positions kept by ``cp_rank``: chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size``."""
    chunk = seq_len // (2 * cp_size)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    tail_start = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([head, torch.arange(tail_start, tail_start + chunk, device=device)])


def gather_order(seq_len: int, cp_size: int, device: torch.device | None = None) -> torch.Tensor:
    """The sequence positions of the gathered (rank-major) parts of every rank, in gather order."""
    return torch.cat([headtail_indices(seq_len, cp_size, r, device) for r in range(cp_size)])


class ContextParallelPlacement(Placement):
    """Each rank of ``cp_mesh`` holds its head-tail part of every sequence (``shard_batch``)."""

    def __init__(self, device: torch.device, cp_mesh: DeviceMesh) -> None:
        super().__init__(device)
        self.cp_mesh, self.parts = cp_mesh, cp_mesh.size()

    def place(self, batch: Batch[F]) -> Batch[F]:
        return super().place(shard_batch(batch, self.cp_mesh))

    def add_parts(self, values: torch.Tensor) -> torch.Tensor:
        return all_reduce_with_grad(values, group=self.cp_mesh.get_group())

    def whole_sequences(self, values: torch.Tensor) -> torch.Tensor:
        gathered = funcol.all_gather_tensor_autograd(values.contiguous(), gather_dim=1, group=self.cp_mesh.get_group())
        order = gather_order(gathered.shape[1], self.parts, values.device)
        return gathered.index_select(1, torch.argsort(order))


def sequence_placement(device: torch.device, cp_mesh: DeviceMesh | None) -> Placement:
    """Where this rank's microbatches run: split over ``cp_mesh`` (None: whole sequences), on ``device``."""
    return Placement(device) if cp_mesh is None else ContextParallelPlacement(device, cp_mesh)


def shard_batch(batch: Batch, cp_mesh: DeviceMesh) -> Batch:
    """This rank's part of every sequence of ``batch`` (the core and the objective's per-token fields), with the
    tokens' global positions."""
    index = headtail_indices(batch.tokens.shape[1], cp_mesh.size(), cp_mesh.get_local_rank(), batch.tokens.device)
    return batch.split_sequence(index)


@dataclass(frozen=True)
class ChunkMasks:
    """The masks of one context-parallel forward's layers with one sliding window (or none).

    Either a block mask over this rank's queries and the gathered keys in gather (rank-major) order
    (flex), or, for the dense kernel, the gather order as global positions, the number of keys the head
    and the tail query chunks can see (a prefix of the sequence in global order) and their masks.
    """

    block_mask: BlockMask | None = None
    order: torch.Tensor | None = None
    """Index into the gathered keys that puts the first ``key_limits[1]`` of them in sequence order."""
    key_limits: tuple[int, int] = (0, 0)
    masks: tuple[torch.Tensor, torch.Tensor] | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scores: Scores = PLAIN_SCORES) -> torch.Tensor:
        """Local queries ``[B, S / cp, H, D]`` to gathered keys/values ``[B, S, H_kv, D]`` (rank-major), with the
        layer's logit rule (scale, soft-capping)."""
        if self.block_mask is not None:
            return flex(q, k, v, self.block_mask, scores)
        assert self.order is not None and self.masks is not None
        k, v = k.index_select(1, self.order), v.index_select(1, self.order)
        chunk, (head_keys, _) = q.shape[1] // 2, self.key_limits
        head = sdpa(q[:, :chunk], k[:, :head_keys], v[:, :head_keys], self.masks[0], scores)
        tail = sdpa(q[:, chunk:], k, v, self.masks[1], scores)
        return torch.cat([head, tail], dim=1)


@dataclass(frozen=True)
class SplitSequence:
    """What the attention calls of one context-parallel forward share (``AttentionInputs.plan_state``; a backend
    model's ``AttentionContext.split``): the masks of this rank's queries over the gathered keys, one per sliding
    window its layers use (None: the global layers), and the group the keys and values are gathered over."""

    masks: dict[int | None, ChunkMasks]
    group: object

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, scores: Scores = PLAIN_SCORES
    ) -> torch.Tensor:
        """Local queries ``[B, S / cp, H, D]`` to the keys/values of the whole sequence, gathered from this rank's
        ``[B, S / cp, H_kv, D]`` ones, in a layer with sliding ``window``."""
        if window not in self.masks:
            raise RuntimeError(f"no context-parallel mask was prepared for sliding window {window}")
        k = funcol.all_gather_tensor_autograd(k.contiguous(), gather_dim=1, group=self.group)
        v = funcol.all_gather_tensor_autograd(v.contiguous(), gather_dim=1, group=self.group)
        return self.masks[window].attend(q, k, v, scores)


@dataclass(frozen=True)
class SequenceSplitter:
    """Makes each forward's ``SplitSequence`` from its local positions, document and parent ids: gathers positions
    and documents once (not per layer) and builds the masks of each window. A backend model holds one
    (``TransformersModel.context_split``); a native decoder's class is swapped for one that uses it
    (``_ContextParallelDecoder``)."""

    group: object
    size: int
    rank: int

    def __call__(
        self,
        positions: torch.Tensor | None,
        documents: torch.Tensor | None,
        parents: torch.Tensor | None,
        windows: Iterable[int | None],
        backend: AttentionBackend,
    ) -> SplitSequence:
        if positions is None:
            raise ValueError("context parallel attention needs the tokens' global positions")
        if documents is not None:
            positions = positions.expand_as(documents)
        elif positions.dim() == 1:
            positions = positions[None]

        def gather(t: torch.Tensor) -> torch.Tensor:
            return funcol.all_gather_tensor(t.contiguous(), gather_dim=1, group=self.group)

        key_positions = gather(positions)
        key_documents = None if documents is None else gather(documents)
        kernel = masked_kernel(backend, positions.device)
        masks = {
            window: chunk_masks(
                positions,
                key_positions,
                documents,
                key_documents,
                cp_size=self.size,
                cp_rank=self.rank,
                kernel=kernel,
                parents=parents,
                window=window,
            )  # fmt: skip
            for window in {None, *windows}
        }
        return SplitSequence(masks, self.group)


class _ContextParallelDecoder:
    """Mixin overriding ``Decoder.prepare_attention``: the forward's ``SplitSequence`` (the parent ids of shared-prompt
    rows are needed for the local queries only)."""

    splitter: SequenceSplitter
    attention_backend: AttentionBackend

    def prepare_attention(self, inputs: AttentionInputs) -> AttentionInputs:
        windows = {layer.attention.window for layer in self.layers.values()}
        state = self.splitter(inputs.positions, inputs.document_ids, inputs.parent_ids, windows, self.attention_backend)
        return dataclasses.replace(inputs, plan_state=state)


def chunk_masks(
    positions: torch.Tensor,
    key_positions: torch.Tensor,
    documents: torch.Tensor | None,
    key_documents: torch.Tensor | None,
    *,
    cp_size: int,
    cp_rank: int,
    kernel: Literal["sdpa", "flex"],
    parents: torch.Tensor | None = None,
    window: int | None = None,
) -> ChunkMasks:
    """The masks of ``cp_rank``'s queries (``[B, S / cp]`` positions, document ids and, for shared-prompt rows,
    parent ids) over the gathered keys (``[B, S]``, rank-major as all-gather returns them), in a layer with sliding
    ``window``. A query sees its parent's keys only at columns before its own (a prompt precedes its responses), and a
    window only hides more, so the key limits hold."""
    if kernel == "flex":
        mask = document_block_mask(positions, key_positions, documents, key_documents, window, q_parents=parents)
        return ChunkMasks(block_mask=mask)
    seq_len, chunk = key_positions.shape[1], positions.shape[1] // 2
    key_limits = ((cp_rank + 1) * chunk, (2 * cp_size - cp_rank) * chunk)
    order = torch.argsort(gather_order(seq_len, cp_size, positions.device))[: key_limits[1]]
    key_positions = key_positions.index_select(1, order)
    key_documents = None if key_documents is None else key_documents.index_select(1, order)
    q_head, q_tail, k_head = positions[:, :chunk], positions[:, chunk:], key_positions[:, : key_limits[0]]
    d_head = d_tail = dk_head = p_head = p_tail = None  # (no documents: one per row, causal by position)
    if documents is not None and key_documents is not None:
        d_head, d_tail, dk_head = documents[:, :chunk], documents[:, chunk:], key_documents[:, : key_limits[0]]
        p_head, p_tail = (None, None) if parents is None else (parents[:, :chunk], parents[:, chunk:])
    masks = (
        document_causal_mask(q_head, k_head, d_head, dk_head, window, q_parents=p_head),
        document_causal_mask(q_tail, key_positions, d_tail, key_documents, window, q_parents=p_tail),
    )
    return ChunkMasks(order=order, key_limits=key_limits, masks=masks)


class _ContextParallelAttend:
    """Mixin overriding ``Attention.attend``: local queries attend to the gathered sequence."""

    window: int | None
    scores: Scores

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        if not isinstance(inputs.plan_state, SplitSequence):
            raise ValueError("context parallel attention runs inside a decoder made context parallel with it")
        return inputs.plan_state.attend(q, k, v, self.window, self.scores)


_CLASSES: dict[type, type] = {}


def _swap_class(module: nn.Module, mixin: type) -> None:
    """Give ``module`` a subclass of its class with ``mixin``'s methods first (one subclass per class)."""
    cls = type(module)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ContextParallel{cls.__name__}", (mixin, cls), {})
    module.__class__ = _CLASSES[cls]


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Make ``model`` (a decoder, a transformers backend model, or a pipeline stage of one) and its attention modules
    context-parallel over ``cp_mesh``, in place."""
    splitter = SequenceSplitter(cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank())
    if hasattr(model, "context_split"):  # (a backend model: its attention function asks the splitter)
        model.context_split = splitter
        return
    if not isinstance(model, Decoder):
        raise TypeError(f"context parallelism applies to a Decoder, not {type(model).__name__}")
    if not isinstance(model, _ContextParallelDecoder):
        _swap_class(model, _ContextParallelDecoder)
    model.splitter = splitter
    for module in model.modules():
        if isinstance(module, Attention) and not isinstance(module, _ContextParallelAttend):
            _swap_class(module, _ContextParallelAttend)
