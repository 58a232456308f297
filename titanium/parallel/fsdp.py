"""FSDP2 / HSDP wrapping of a decoder model (per block, then the root)."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as _fully_shard
from torch.distributed.tensor import DTensor, Shard

from titanium.models.common.moe import MoE


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """Shard over `mesh` (1-D: FSDP, 2-D: HSDP) in units: the embedding, each transformer block, the
    final norm with the output projection, and the root (whatever is left). Each unit's weights are
    gathered only while it runs, so the large embedding and output matrices are never all resident.
    The output unit is not resharded after forward: its backward comes right after. Tied embeddings
    (one parameter in two modules) stay with the root, which for the same reason is not resharded after
    forward either (and so a loss that applies the output projection itself, chunk by chunk, finds its
    weight gathered).

    Under expert parallelism (``expert_mesh``) each MoE layer's experts are a unit of their own, sharded over
    ``expert_mesh`` (the data-parallel ranks that hold the same experts); they are already divided over the ep
    ranks, which together see every token routed to them, so summing over ``expert_mesh`` completes their
    gradients.

    Gradients are *summed* across ranks: the loss is already divided by the global valid-token
    count, so FSDP's default averaging would divide a second time. Forcing plain SUM collectives
    (instead of a pre-multiplied sum by 1.0) also keeps gloo, which has no PREMUL_SUM, working.

    A parameter with fewer rows than there are shards is split along a larger dimension (``shard_dim``).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    embedding = getattr(model, "tok_embeddings", None)
    tail = [m for m in (getattr(model, "norm", None), getattr(model, "output", None)) if m is not None]
    output = getattr(model, "output", None)
    tied = embedding is not None and output is not None and output.weight is embedding.weight
    if embedding is not None and not tied:
        fully_shard(embedding, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    for block in model.layers.values():
        experts = [m.experts for m in block.modules() if isinstance(m, MoE)] if expert_mesh is not None else []
        for unit in experts:  # (a native block's MoE, or one inside a backend model's block)
            fully_shard(unit, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    if tail and not tied:
        fully_shard(tail, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def fully_shard(module: nn.Module | list[nn.Module], *, mesh: DeviceMesh, **kwargs) -> None:
    """``torch``'s ``fully_shard`` with each parameter split along ``shard_dim``'s dimension."""
    _fully_shard(module, mesh=mesh, shard_placement_fn=partial(shard_dim, shards=mesh.size(mesh.ndim - 1)), **kwargs)


def shard_dim(param: nn.Parameter, shards: int) -> Shard | None:
    """Where FSDP splits ``param`` (this rank's part of it: an expert-parallel DTensor's local experts): along its
    first dimension (FSDP's default, None), unless that has fewer rows than there are shards and another has enough;
    then along the largest. (Llama 4 Scout's 16 stacked experts over 64 ranks would leave 48 ranks nothing and 16 a
    whole expert of every layer: 6.2B parameters a rank instead of 1.7B; under EP 8 the 2 experts of a rank's group,
    split 8 ways by rows, would leave 6 of 8 ranks none.)"""
    shape = param.to_local().shape if isinstance(param, DTensor) else param.shape
    if len(shape) < 2 or shape[0] >= shards:
        return None
    largest = max(range(len(shape)), key=lambda d: shape[d])
    return Shard(largest) if shape[largest] >= shards else None
