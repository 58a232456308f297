"""FSDP2 / HSDP wrapping of a decoder model (per block, then the root)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
) -> None:
    """Shard each transformer block and the root over `mesh` (1-D: FSDP, 2-D: HSDP).

    Gradients are *summed* across ranks: the loss is already divided by the global valid-token
    count, so FSDP's default averaging would divide a second time. Forcing plain SUM collectives
    (instead of a pre-multiplied sum by 1.0) also keeps gloo, which has no PREMUL_SUM, working.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
