"""Fold adapters into their base weights: ``W + scale * B @ A``, the plain model that LoRA trained (DoRA: that
sum with each row rescaled to its trained magnitude, as PEFT's ``merge_and_unload``).

Used for the merged Hugging Face export, which any tool can load without PEFT. NF4 base weights are
dequantized first.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from titanium.peft.dora import merge_direction
from titanium.peft.expert_lora import PROJECTIONS, expert_lora_modules
from titanium.peft.lora import adapter_key_parts, is_lora_param, lora_modules
from titanium.peft.nf4 import dequantize


def lora_scales(model: nn.Module) -> dict[str, float]:
    """Adapted weight (name without ``.weight``) -> its update's scale (``alpha / rank``); empty for a model without
    adapters. Stacked experts count each projection (``layers.0.moe.experts.w1``)."""
    scales = {name: module.lora_scale for name, module in lora_modules(model)}
    for name, experts in expert_lora_modules(model):
        scales.update({f"{name}.{projection}": experts.lora_scale for projection in PROJECTIONS})
    return scales


@torch.no_grad()
def merge_lora_state(state: Mapping[str, torch.Tensor], scales: Mapping[str, float]) -> dict[str, torch.Tensor]:
    """``state`` with each adapted ``<layer>.weight`` replaced by ``W + scale * B @ A`` (rescaled by DoRA's
    ``<layer>.lora_magnitude`` where there is one) and no adapter keys.

    The merge is computed in float32 and the result keeps the base weight's (dequantized) dtype.
    """
    parts = {adapter_key_parts(k): k for k in state if is_lora_param(k)}  # (layer, lora_a) -> its key
    orphans = {key for (layer, _), key in parts.items() if layer not in scales}
    if orphans:
        raise ValueError(f"merge_lora_state: adapter keys without a scale: {sorted(orphans)[:4]}")
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if is_lora_param(key):
            continue
        layer = key.removesuffix(".weight")
        if layer in scales:  # (B @ A is batched over the experts of stacked expert weights)
            a, b = state[parts[layer, "lora_a"]], state[parts[layer, "lora_b"]]
            dense = dequantize(value)
            delta = b.to(dense.device, torch.float32) @ a.to(dense.device, torch.float32)
            merged = dense.float() + scales[layer] * delta
            magnitude = state.get(parts.get((layer, "lora_magnitude"), ""))
            if magnitude is not None:
                merged = merge_direction(merged, magnitude.to(dense.device))
            value = merged.to(dense.dtype)
        out[key] = value
    return out


def merge_lora(model: nn.Module) -> dict[str, torch.Tensor]:
    """The merged state dict of an unsharded model (the model itself is left as it is)."""
    return merge_lora_state(model.state_dict(), lora_scales(model))


def merged_full_state_dict(model: nn.Module, keep: bool | None = None) -> dict[str, torch.Tensor] | None:
    """The merged, full state dict of a model in any data-parallel layout: on CPU where ``keep`` (default:
    on rank 0), None elsewhere.

    Collective when distributed (every rank calls); see ``dense_full_tensor``.
    """
    if not dist.is_initialized():
        return merge_lora(model)
    keep = dist.get_rank() == 0 if keep is None else keep
    full: dict[str, torch.Tensor] = {}
    for key, value in get_model_state_dict(model).items():
        value = dense_full_tensor(value)
        if keep:
            full[key] = value.detach().cpu()
    return merge_lora_state(full, lora_scales(model)) if keep else None


def dense_full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A state-dict value as one plain dense tensor on its device: gathered if it is a DTensor (a collective over
    its mesh), NF4 dequantized. Sharded NF4 weights are dequantized shard by shard (each FSDP shard holds whole NF4
    groups) and gathered as dense tensors, so only plain all-gathers run."""
    if isinstance(value, DTensor):
        local = dequantize(value.to_local())
        value = DTensor.from_local(
            local, value.device_mesh, value.placements, shape=value.shape, stride=value.stride()
        ).full_tensor()
    return dequantize(value)
