"""Tensor-parallel styles for a group of linear layers (torch's, or torchao's float8 ones), and the plan of a
one-output score head.

A family's TP plan (``models/<family>/parallelize.py``) asks here which styles to use for the layers that
share one input (a block's q/k/v projections, the MLP's gate and up projections). When every layer of the
group is a torchao ``Float8Linear`` with tensorwise dynamic scaling (the float8 converter ran with the
tensorwise recipe), torchao's styles cast the activations to float8 *before* the sequence-parallel
all-gather, so the gather moves half the bytes, and the gradients are cast before their reduce-scatter.
Rowwise-scaled layers, groups in which some layers stayed in high precision, and CPU meshes (gloo cannot
carry float8 tensors) keep torch's styles: float8 layers accept high-precision DTensor inputs and compute the
same numbers, only the communication stays in high precision.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    parallelize_module,
)


@dataclass(frozen=True)
class LinearStyles:
    colwise: type[ColwiseParallel] = ColwiseParallel
    rowwise: type[RowwiseParallel] = RowwiseParallel
    prepare_input: type[PrepareModuleInput] = PrepareModuleInput


def linear_styles(device_type: str, *layers: nn.Module) -> LinearStyles:
    """torchao's float8 styles if every layer is a tensorwise float8 layer and the mesh is not on CPU, else torch's."""
    float8_linear = sys.modules.get("torchao.float8.float8_linear")  # no Float8Linear exists unless loaded
    if (
        device_type == "cpu"
        or float8_linear is None
        or not all(_tensorwise_float8(layer, float8_linear.Float8Linear) for layer in layers)
    ):
        return LinearStyles()
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return LinearStyles(Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput)


def _tensorwise_float8(layer: nn.Module, float8_cls: type) -> bool:
    from torchao.float8.config import ScalingGranularity

    if not isinstance(layer, float8_cls):
        return False
    config = layer.config
    casts = (config.cast_config_input, config.cast_config_weight, config.cast_config_grad_output)
    return all(cast.scaling_granularity is ScalingGranularity.TENSORWISE for cast in casts)


def score_head_plan(head: nn.Module, tp_mesh: DeviceMesh) -> None:
    """A reward or value model's ``[1, dim]`` score head, which has no vocabulary rows to split: its weight is
    replicated over the tensor-parallel ranks, the final norm's output (split along the sequence: sequence parallel)
    is gathered whole first, and every rank scores every position, giving the scores ``[B, S, 1]`` as a plain tensor
    with or without loss parallel (each rank computes the weight's whole gradient). Scoring each rank's own part of
    the sequence would save the gather of a ``[B, S, dim]`` activation, but DTensor's linear on an input split along
    a middle dimension fails on torch 2.11 ("Attempted to flatten multiple dimensions")."""
    distribute_module(head, tp_mesh)  # (parameters replicated)
    whole = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=False)
    parallelize_module(head, tp_mesh, whole)
    local = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_output=True)
    parallelize_module(head, tp_mesh, local)
