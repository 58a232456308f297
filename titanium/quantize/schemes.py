"""Quantization schemes by name: each is one torchao post-training config plus what it needs from the model and
the machine. QAT (qat.py: it fake-quantizes with a scheme's config and converts to it at the end) and the serving
export (titanium/checkpoint/quantized_export.py) read the same table, so a QAT-trained model exported with its
scheme is quantized exactly as it was trained.

What runs where (torchao 0.18, checked on CPU): the int8 schemes and the int4 codes stored one per byte
(``IntxUnpackedToInt8Tensor``) quantize, run and load in ``transformers`` on CPU. Float8 dynamic quantization
asserts CUDA compute capability 8.9+, and torchao's packed int4 layouts need CUDA: the tinygemm tile layout here
(bfloat16, compute capability 8.0+), the default "plain" one the ``mslk`` package; 0.18 has no packed int4
layout for CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchao.quantization import (
    Float8DynamicActivationFloat8WeightConfig,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8DynamicActivationIntxWeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
)
from torchao.quantization.granularity import PerGroup, PerRow

from titanium.config.loader import ConfigError
from titanium.parallel.params import clean_fqn
from titanium.quantize import check_filters_match, filtered_by_name


@dataclass(frozen=True)
class Scheme:
    summary: str
    """What the weights (and activations) become, for --help and the docs."""
    config: Callable[[int], Any]
    """group_size -> torchao's config (``quantize_(model, config)``)."""
    grouped: bool = False
    """One weight scale per ``group_size`` inputs: the group size must divide every quantized layer's inputs."""
    group_sizes: tuple[int, ...] = ()
    """The only group sizes the kernel takes (empty: any divisor)."""
    cuda_capability: tuple[int, int] | None = None
    """The CUDA compute capability its kernels need; None: runs on CPU too."""
    dtype: torch.dtype | None = None
    """The only weight dtype it quantizes from (None: any float)."""
    multiple_of: int = 1
    """Every quantized layer's input and output sizes must be multiples of this (float8 matmuls: 16)."""


SCHEMES: dict[str, Scheme] = {
    "int4_weight_only": Scheme(
        "int4 weights, symmetric, one scale per group_size inputs, stored one code per byte (torchao "
        "IntxWeightOnlyConfig); activations stay in high precision",
        lambda group: IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group)),
        grouped=True,
    ),
    "int8_dynamic_activation_int4_weight": Scheme(
        "the int4 weights of int4_weight_only, and each token's activations quantized to int8 at run time "
        "(torchao Int8DynamicActivationIntxWeightConfig; ExecuTorch's 8da4w)",
        lambda group: Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4, weight_granularity=PerGroup(group)
        ),
        grouped=True,
    ),
    "int8_weight_only": Scheme(
        "int8 weights, one scale per output row (torchao Int8WeightOnlyConfig)",
        lambda group: Int8WeightOnlyConfig(),
    ),
    "int8_dynamic_activation_int8_weight": Scheme(
        "int8 weights per output row and each token's activations quantized to int8 at run time "
        "(torchao Int8DynamicActivationInt8WeightConfig)",
        lambda group: Int8DynamicActivationInt8WeightConfig(),
    ),
    "float8_dynamic_activation_float8_weight": Scheme(
        "float8 (e4m3) weights per output row and each token's activations cast to float8 at run time "
        "(torchao Float8DynamicActivationFloat8WeightConfig, PerRow); bfloat16, CUDA only",
        lambda group: Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
        cuda_capability=(8, 9),
        dtype=torch.bfloat16,
        multiple_of=16,
    ),
    "int4_weight_only_tinygemm": Scheme(
        "int4 weights, asymmetric, one scale and zero per group_size inputs, packed two per byte for CUDA's "
        "tinygemm kernel (torchao Int4WeightOnlyConfig, tile_packed_to_4d); bfloat16, CUDA only",
        lambda group: Int4WeightOnlyConfig(group_size=group, int4_packing_format="tile_packed_to_4d"),
        grouped=True,
        group_sizes=(32, 64, 128, 256),
        cuda_capability=(8, 0),
        dtype=torch.bfloat16,
    ),
}


def check_device(name: str, device: torch.device, flag: str = "--scheme") -> None:
    """A scheme that needs CUDA kernels on a machine that cannot run them is a config error naming the others."""
    need = SCHEMES[name].cuda_capability
    if need is None:
        return
    cpu_schemes = ", ".join(n for n, s in SCHEMES.items() if s.cuda_capability is None)
    if device.type != "cuda":
        raise ConfigError(
            f"{flag} {name} needs a CUDA GPU (compute capability {need[0]}.{need[1]}+; torchao has no CPU kernels "
            f"for it) and this run is on {device.type}; on CPU use one of {cpu_schemes}"
        )
    have = torch.cuda.get_device_capability(device)
    if have < need:
        raise ConfigError(
            f"{flag} {name} needs CUDA compute capability {need[0]}.{need[1]}+; {torch.cuda.get_device_name(device)} "
            f"has {have[0]}.{have[1]}: use one of {cpu_schemes}"
        )


def quantized_layers(
    model: nn.Module,
    name: str,
    group_size: int,
    filter_fqns: Iterable[str],
    *,
    flags: tuple[str, str] = ("--group-size", "--filter-fqns"),
) -> list[str]:
    """Clean names of the linear layers scheme ``name`` quantizes: those whose name contains none of
    ``filter_fqns``. A layer whose sizes the scheme cannot take, or whose weight is the embedding's (tied), is a
    config error naming ``flags`` (the group size and filter options of the caller: CLI or config keys)."""
    scheme, (group_flag, filter_flag) = SCHEMES[name], flags
    if scheme.grouped and group_size < 1:
        raise ConfigError(f"{group_flag} must be >= 1 (inputs per weight scale; e.g. 32), got {group_size}")
    if scheme.grouped and scheme.group_sizes and group_size not in scheme.group_sizes:
        sizes = ", ".join(map(str, scheme.group_sizes))
        raise ConfigError(f"{group_flag} {group_size}: scheme {name} takes group sizes {sizes}")
    embedding = getattr(model, "tok_embeddings", None)
    linear = [clean_fqn(fqn) for fqn, module in model.named_modules() if isinstance(module, nn.Linear)]
    check_filters_match(filter_fqns, linear, filter_flag)
    layers = []
    for fqn, module in model.named_modules():
        layer = clean_fqn(fqn)
        if not isinstance(module, nn.Linear) or filtered_by_name(layer, filter_fqns):
            continue
        if scheme.grouped and module.in_features % group_size:
            raise ConfigError(
                f"{group_flag} {group_size} does not divide the {module.in_features} inputs of {layer}; use a "
                f"divisor of it or add {layer!r} to {filter_flag}"
            )
        if module.in_features % scheme.multiple_of or module.out_features % scheme.multiple_of:
            raise ConfigError(
                f"{layer} is {module.out_features} x {module.in_features}; scheme {name} needs both sizes to be "
                f"multiples of {scheme.multiple_of}: add {layer!r} to {filter_flag}"
            )
        if embedding is not None and module.weight is embedding.weight:
            raise ConfigError(
                f"{filter_flag}: {layer} shares its weight with the embedding (tied embeddings); keep it filtered"
            )
        layers.append(layer)
    return layers
