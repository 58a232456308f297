"""Parameter names and values across parallel wrappers: what maps a sharded model back to one process's."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

# Name components that wrappers (activation checkpointing, torch.compile, FSDP1) insert into FQNs.
_WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def clean_fqn(name: str) -> str:
    """A parameter/module name without wrapper components, as in checkpoints and ``state_dict()``."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


@torch.no_grad()
def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full (unsharded) value ``full`` into ``param``, which may be a DTensor: each rank keeps its shard.

    Every rank must pass the same ``full``; no communication happens (``src_data_rank=None``).
    """
    if isinstance(param, DTensor):
        local = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full)


def _along(placement: Placement, dim: int) -> Placement:
    """``placement`` as it acts on dimension ``dim`` alone, for a 1-D tensor of that dimension's positions."""
    if isinstance(placement, _StridedShard):
        return _StridedShard(0, split_factor=placement.split_factor) if placement.dim == dim else Replicate()
    if isinstance(placement, Shard):
        return Shard(0) if placement.dim == dim else Replicate()
    assert isinstance(placement, Replicate), f"a parameter placed {placement}"
    return placement


def local_indices(value: torch.Tensor) -> list[torch.Tensor | None]:
    """Per dimension, the global positions (CPU int64, in local order) that this rank's shard of ``value`` holds;
    None for a whole dimension. A plain tensor holds every position.

    Found without communication by sharding each dimension's positions as the DTensor shards that dimension
    (strided FSDP-over-EP shards included), so a reader can fetch just these rows and columns of a full tensor.
    """
    if not isinstance(value, DTensor):
        return [None] * value.dim()
    out: list[torch.Tensor | None] = []
    for dim, size in enumerate(value.shape):
        placements = [_along(p, dim) for p in value.placements]
        if all(isinstance(p, Replicate) for p in placements):
            out.append(None)
            continue
        positions = torch.arange(size, device=value.device)
        local = distribute_tensor(positions, value.device_mesh, placements, src_data_rank=None).to_local()
        out.append(local.cpu())
    return out
