"""Parameter names and values across parallel wrappers: what maps a sharded model back to one process's."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

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
