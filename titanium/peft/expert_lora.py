"""LoRA on the stacked experts of an MoE layer: per expert ``e`` and projection, ``W[e] + scale * B[e] @ A[e]``.

The experts' weights are ``[E, out, in]`` parameters, not ``nn.Linear`` layers, so their adapters are stacked too:
``lora_a.w1`` ``[E, r, in]`` and ``lora_b.w1`` ``[E, out, r]`` (children ``lora_a`` / ``lora_b`` of the experts
module, so every adapter name has a ``lora_a``/``lora_b`` part and the base checkpoint never sees them). The update
is added to the weights before the grouped GEMM (``GroupedExperts.weight_update``): one batched matmul per
projection, the same sum that PEFT computes for transformers' stacked experts. Being per expert along the first
dimension, the adapters are sharded with the weights by expert parallelism and FSDP. Dropout on the adapter's input
has no place in a weight update, so it is refused for experts.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titanium.models.common.moe import GroupedExperts
from titanium.parallel.params import copy_full_into

PROJECTIONS = ("w1", "w2", "w3")


class ExpertFactors(nn.Module):
    """One low-rank factor of each projection, stacked over the experts (``w1``, ``w2``, ``w3``)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], like: torch.Tensor) -> None:
        super().__init__()
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(shape, device=like.device, dtype=like.dtype)))


def add_expert_adapters(experts: GroupedExperts, rank: int, scale: float) -> None:
    """Give ``experts`` (on the meta device, before parallelism) zero-initialisable adapters of ``rank``."""
    shapes = {name: tuple(getattr(experts, name).shape) for name in PROJECTIONS}  # [E, out, in]
    experts.lora_a = ExpertFactors({n: (e, rank, i) for n, (e, _, i) in shapes.items()}, experts.w1)
    experts.lora_b = ExpertFactors({n: (e, o, rank) for n, (e, o, _) in shapes.items()}, experts.w1)
    experts.lora_scale = scale
    experts.lora_enabled = True
    experts.weight_update = lora_weights


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def lora_weights(experts: GroupedExperts, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """``weights`` (this rank's experts) plus ``scale * B @ A`` of the same experts; unchanged while disabled."""
    if not experts.lora_enabled:
        return weights
    out = []
    for name, weight in zip(PROJECTIONS, weights, strict=True):
        a, b = _local(getattr(experts.lora_a, name)), _local(getattr(experts.lora_b, name))
        out.append(weight + experts.lora_scale * torch.bmm(b.to(weight.dtype), a.to(weight.dtype)))
    return out


def expert_lora_modules(model: nn.Module) -> list[tuple[str, GroupedExperts]]:
    """``(name, experts)`` of every experts module with adapters."""
    from titanium.parallel.params import clean_fqn

    return [
        (clean_fqn(name), module)
        for name, module in model.named_modules()
        if isinstance(module, GroupedExperts) and module.weight_update is lora_weights
    ]


@torch.no_grad()
def init_expert_lora(name: str, experts: GroupedExperts, seed: int) -> None:
    """``A`` Kaiming-uniform per expert (fan-in: the projection's input width, as PEFT's ``lora_A`` of stacked
    experts), ``B`` zeros; drawn on the CPU from the seed and the name, so the values do not depend on the layout."""
    for projection in PROJECTIONS:
        a_param, b_param = getattr(experts.lora_a, projection), getattr(experts.lora_b, projection)
        generator = torch.Generator().manual_seed((seed + zlib.crc32(f"{name}.{projection}".encode())) % 2**63)
        e, r, i = a_param.shape
        a = torch.empty(e * r, i)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        copy_full_into(a_param, a.view(e, r, i))
        copy_full_into(b_param, torch.zeros(tuple(b_param.shape)))
