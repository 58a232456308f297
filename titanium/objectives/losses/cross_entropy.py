"""Token cross-entropy for the pretrain and SFT objectives, from full logits or chunk by chunk.

With ``[training] loss_chunk_size`` the objective asks the loop for the final hidden states and the output
projection (``loss_input = "hidden"``) instead of logits. The tokens that carry a label are picked out first
(prompt and padding tokens never reach the projection), then ``linear_cross_entropy_sum`` projects and scores
them ``chunk_size`` at a time: only one chunk's ``[chunk, vocab]`` logits exist at any moment, in the forward
and in the backward, which recomputes them (one extra projection matmul) instead of keeping them.

Under tensor parallelism the projection is split by vocabulary rows: each rank scores every token against its
slice of the vocabulary, and one all-gather per chunk of each rank's log-sum-exp and target logit completes
the softmax (the chunked form of loss parallel; the full logits are never gathered either).

The positions of the labelled tokens are found in ``prepare``, before the forward is queued, so the one host
sync they need (their number decides the shapes) waits for nothing but the labels' copy to the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from titanium.batch import Batch, Fields, per_token
from titanium.config.loader import ConfigError
from titanium.data.vision import images_of
from titanium.objectives.base import IGNORE_INDEX, ModelOutput


@dataclass
class TokenFields(Fields):
    """A next-token cross-entropy batch's own fields: the label of every position; units are labelled tokens."""

    labels: torch.Tensor = per_token()
    """``[rows, seq]`` the token each position must predict; IGNORE_INDEX where nothing is learned."""
    label_index: torch.Tensor | None = None
    """Chunked: flat positions of the labelled tokens, found in ``prepare`` (whole: no pipeline with chunks)."""

    def units(self) -> torch.Tensor:
        return (self.labels != IGNORE_INDEX).sum()


def token_batch(rows: dict[str, torch.Tensor], fields: type[TokenFields] = TokenFields, **extra: Any) -> Batch:
    """A typed batch from a data loader's rows (``input``, ``label``; packed rows also ``positions`` and
    ``document_ids``); ``extra`` are further fields of ``fields``."""
    return Batch(
        rows["input"],
        fields(labels=rows["label"], **extra),
        positions=rows.get("positions"),
        document_ids=rows.get("document_ids"),
        images=images_of(rows),
    )


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in float32, skipping IGNORE_INDEX labels."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(cap(hidden_i @ weight.T), target_i), chunk by chunk over the tokens i; logits recomputed in backward.

    As in the unchunked path, each chunk's logits come out of the matmul in the compute dtype and the softmax
    runs in float32; the gradients go back through the matmuls in the compute dtype. Saved for backward: the
    inputs and each token's log-sum-exp (float32), no logits. ``softcap`` (Gemma 2's final logit soft-capping)
    makes the logits ``softcap * tanh(z / softcap)`` of the matmul's ``z``, in float32 as the model's forward does.

    With ``group`` (tensor parallel), ``weight`` holds vocabulary rows ``vocab_start...`` of the projection:
    the result is the full cross-entropy on every rank, the weight gradient is this rank's rows, and the
    hidden-state gradient is this rank's partial sum (the caller reduces it over the group).
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, targets, chunk_size: int, group: dist.ProcessGroup | None, vocab_start: int, softcap
    ):
        lse = torch.empty(hidden.shape[0], device=hidden.device, dtype=torch.float32)
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            logits = capped((hidden[start:end] @ weight.t()).float(), softcap)
            chunk_lse, target_logits = _softmax_terms(logits, targets[start:end] - vocab_start, group)
            lse[start:end] = chunk_lse
            total += (chunk_lse - target_logits).sum()
            del logits
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_size, ctx.vocab_start, ctx.softcap = chunk_size, vocab_start, softcap
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            chunk = hidden[start:end]
            # d CE / d logits = softmax - onehot(target), times the incoming gradient of the sum
            logits, tanh = (chunk @ weight.t()).float(), None
            if ctx.softcap is not None:
                tanh = torch.tanh(logits / ctx.softcap)
                logits = tanh * ctx.softcap
            grad_logits = logits.sub_(lse[start:end, None]).exp_()
            local = targets[start:end] - ctx.vocab_start
            mine = (local >= 0) & (local < weight.shape[0])
            rows = torch.arange(chunk.shape[0], device=chunk.device)
            grad_logits[rows, local.clamp(0, weight.shape[0] - 1)] -= mine.float()
            if tanh is not None:  # d (c tanh(z / c)) / dz = 1 - tanh(z / c)^2
                grad_logits.mul_(tanh.square_().neg_().add_(1))
                del tanh
            grad_logits = grad_logits.mul_(grad_total).to(hidden.dtype)
            if need_hidden:
                grad_hidden[start:end] = grad_logits @ weight
            if need_weight:
                grad_weight.addmm_(grad_logits.t(), chunk)
            del grad_logits
        return grad_hidden, grad_weight, None, None, None, None, None


def capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``logits`` under a final soft-cap (Gemma 2's ``softcap * tanh(z / softcap)``), as the decoder's forward."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def _softmax_terms(
    logits: torch.Tensor, local_targets: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's log-sum-exp and target logit. ``logits`` may be one rank's vocabulary slice (``group``): a
    target outside it counts 0 there, and an all-gather of the per-rank pairs completes both."""
    vocab = logits.shape[1]
    mine = (local_targets >= 0) & (local_targets < vocab)
    target_logits = logits.gather(1, local_targets.clamp(0, vocab - 1)[:, None]).squeeze(1) * mine
    lse = torch.logsumexp(logits, dim=-1)
    if group is None:
        return lse, target_logits
    pairs = torch.stack([lse, target_logits])
    ranks = dist.get_world_size(group)
    gathered = torch.empty((ranks * 2, pairs.shape[1]), device=pairs.device, dtype=pairs.dtype)
    dist.all_gather_into_tensor(gathered, pairs, group=group)
    gathered = gathered.view(ranks, 2, -1)
    return torch.logsumexp(gathered[:, 0], dim=0), gathered[:, 1].sum(dim=0)


def linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int, softcap: float | None = None
) -> torch.Tensor:
    """Summed cross-entropy of ``hidden [N, dim] @ weight [vocab, dim].T`` (soft-capped at ``softcap``, if given)
    against ``targets [N]`` (every target a real label), computed ``chunk_size`` tokens at a time so the
    ``[N, vocab]`` logits never exist.

    ``weight`` may be a DTensor split by vocabulary rows over a tensor-parallel mesh (``hidden`` then holds all
    tokens on every rank, and its gradient is a partial sum over that mesh). Under autocast the matmuls run in
    the autocast dtype, as ``nn.Linear`` would; otherwise in ``weight``'s.
    """
    group, vocab_start = None, 0
    if isinstance(weight, DTensor):
        if weight.placements != (Shard(0),):
            raise ValueError(f"expected a projection split by vocabulary rows on one mesh dim, got {weight.placements}")
        group = weight.device_mesh.get_group()
        local = weight.to_local()
        vocab_start = weight.device_mesh.get_local_rank() * local.shape[0]
        weight = local
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    with torch.autocast(device, enabled=False):
        return _LinearCrossEntropy.apply(
            hidden.to(dtype), weight.to(dtype), targets, chunk_size, group, vocab_start, softcap
        )


def _layer_class(projection: nn.Module) -> type:
    layer_cls = type(projection)
    if issubclass(layer_cls, FSDPModule):  # FSDP2 swaps in FSDP<Name>(FSDPModule, <Name>)
        layer_cls = layer_cls.__bases__[-1]
    return layer_cls


def labelled_positions(labels: torch.Tensor) -> torch.Tensor:
    """The flat positions whose label counts (not ``IGNORE_INDEX``): where a loss from hidden states projects. One
    host sync (the count), so objectives find them in ``prepare``, before the forward is queued."""
    return (labels.flatten() != IGNORE_INDEX).nonzero().squeeze(1)


def is_plain_linear(projection: nn.Module) -> bool:
    """Whether an output layer is a plain linear map (not LoRA, float8 or QAT), FSDP-wrapped or not."""
    return _layer_class(projection) is nn.Linear


def whole_hidden(hidden: torch.Tensor) -> torch.Tensor:
    """Final hidden states made whole on every tensor-parallel rank (sequence parallel: gathered differentiably, the
    gradient each rank sends back whole), for a loss every tp rank computes in full; plain tensors as they are."""
    if isinstance(hidden, DTensor):
        hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim).to_local()
    return hidden


def plain_projection_weight(projection: nn.Module, flag: str, way_out: str) -> torch.Tensor:
    """The weight of an output layer that is a plain linear map (a loss that projects by it alone needs one), or a
    ConfigError naming ``flag``, the setting that projects by hand, and ``way_out``, the other fix."""
    layer_cls = _layer_class(projection)
    if layer_cls is not nn.Linear:
        raise ConfigError(
            f"{flag} projects with the output layer's weight alone, but the output layer is a {layer_cls.__name__} "
            f"(LoRA, float8 or QAT on 'output'); keep 'output' out of that conversion or {way_out}"
        )
    return projection.weight


class TokenCrossEntropy:
    """The summed next-token cross-entropy of a batch of ``TokenFields``, as the pretrain and SFT objectives
    compute it: from the model's logits (``chunk_size == 0``), or chunk by chunk from its hidden states."""

    def __init__(self, chunk_size: int) -> None:
        if chunk_size < 0:
            raise ConfigError(f"--training.loss_chunk_size must be >= 0 (0: full logits), got {chunk_size}")
        self.chunk_size = chunk_size
        self.loss_input = "hidden" if chunk_size else "logits"
        """What the objective asks the loop for (``Objective.loss_input``)."""

    def prepare(self, microbatches: list[Batch]) -> list[Batch]:
        """Chunked: add each microbatch's labelled-token positions (see the module docstring)."""
        if self.chunk_size:
            for mb in microbatches:
                mb.fields.label_index = labelled_positions(mb.fields.labels)
        return microbatches

    def __call__(self, output: ModelOutput, batch: Batch[TokenFields]) -> torch.Tensor:
        labels = batch.fields.labels
        if not self.chunk_size:
            return cross_entropy_sum(output.logits, labels)
        weight = plain_projection_weight(output.projection, "--training.loss_chunk_size", "set it to 0")
        hidden = output.hidden
        if isinstance(hidden, DTensor):  # sequence parallel: every rank scores every token (see the docstring)
            n = hidden.device_mesh.ndim
            hidden = hidden.redistribute(placements=[Replicate()] * n).to_local(grad_placements=[Partial()] * n)
        index = batch.fields.label_index
        assert index is not None, "prepare finds the labelled tokens"
        hidden = hidden.flatten(0, 1).index_select(0, index)
        targets = labels.flatten().index_select(0, index)
        softcap = getattr(output.projection, "logit_softcap", None)  # (set by the decoder: Gemma 2's final cap)
        return linear_cross_entropy_sum(hidden, weight, targets, self.chunk_size, softcap)
