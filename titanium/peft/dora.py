"""DoRA (weight-decomposed low-rank adaptation, Liu et al. 2024), computed as PEFT computes it.

A DoRA layer's weight is ``m * V / ||V||`` with ``V = W + scale * B A``: a magnitude ``m`` per output row
(``lora_magnitude``) and a direction, trained apart. ``||V||`` is the L2 norm of each row of ``V`` (across the
inputs), and, as the paper suggests (section 4.3) and PEFT does, it is a constant for autograd: computed without
gradient, so ``m``, ``A`` and ``B`` get their gradients only through the terms below. The layer never forms the
new weight; with ``r = m / ||V||`` it adds to the base layer's output ``W x + b``

    (r - 1) * W x  +  r * scale * B A x

which makes ``r * (W x + scale * B A x) + b``. As in PEFT, while dropout is active (training with
``dropout > 0``) both added terms take the dropped input; the base output keeps the whole input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titanium.peft.nf4 import dequantize


@torch.no_grad()
def weight_norm(module: nn.Linear, full: bool = False) -> torch.Tensor:
    """``||W + scale * B A||`` of each output row of a ``LoRALinear`` (titanium/peft/lora.py, which imports this
    module), in float32, without gradient (NF4 weights dequantized).

    With ``full`` the parameters may be sharded DTensors: they are gathered (collective) and every rank gets
    the whole vector. Inside a forward FSDP has already gathered them."""
    weight, a, b = module.weight, module.lora_a.weight, module.lora_b.weight
    if full:
        weight, a, b = (t.full_tensor() if isinstance(t, DTensor) else t for t in (weight, a, b))
    direction = dequantize(weight).float() + module.lora_scale * (b.float() @ a.float())
    return torch.linalg.vector_norm(direction, dim=1)


def dora_output(
    module: nn.Linear, x: torch.Tensor, dropped: torch.Tensor, base: torch.Tensor, update: torch.Tensor
) -> torch.Tensor:
    """The DoRA layer's output from the base layer's ``base = W x + b`` and the LoRA ``update = scale B A dropped``."""
    assert module.lora_magnitude is not None
    ratio = (module.lora_magnitude / weight_norm(module)).to(base.dtype)
    if module.training and not isinstance(module.lora_dropout, nn.Identity):
        plain = F.linear(dropped, dequantize(module.weight).to(dropped.dtype))
    else:
        plain = base if module.bias is None else base - module.bias
    return base + (ratio - 1) * plain + ratio * update


def merge_direction(direction: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """The merged DoRA weight from ``V = W + scale * B A`` (float32): each row of ``V`` rescaled to its magnitude."""
    return direction * (magnitude.float() / torch.linalg.vector_norm(direction, dim=1)).unsqueeze(1)
