"""Quantized Hugging Face checkpoints, read as the weights they stand for: block-wise FP8 (DeepSeek-V3 and R1, Kimi
K2, the Qwen3 ``-FP8`` models) and MXFP4 experts (GPT-OSS).

- **Block-wise FP8**: ``quantization_config`` ``{"quant_method": "fp8", "weight_block_size": [128, 128]}``; each
  quantized weight ``W`` is stored as ``float8_e4m3fn`` beside ``W_scale_inv`` (float32, or UE8M0), one scale per
  block of rows and columns: the weight is ``W[r, c] * W_scale_inv[r // block_rows, c // block_cols]``. A rank's slice
  is read with the scales of its blocks, read at ``positions // block`` (one per weight element: ``SliceReader.read``
  picks repeated positions out of the box it reads).
- **MXFP4** (``quant_method`` ``mxfp4``): an MoE's stacked expert weight ``P`` (``[experts, in, out]`` in memory) is
  stored as ``P_blocks`` ``[experts, out, in / 32, 16]`` (two FP4 E2M1 values per byte, the low nibble first) and
  ``P_scales`` ``[experts, out, in / 32]`` (a power of two per group of 32 inputs, its exponent biased by 127). A
  rank reads the bytes and scales of the groups its slice touches and dequantizes them, transposed to memory's order.

titanium trains the dequantized weights (in the run's parameter dtype); an export holds them, named as in memory
(``P``, not ``P_blocks``), and its ``config.json`` has no ``quantization_config``. Other ``quant_method``s (GPTQ,
AWQ, bitsandbytes...) store integers whose meaning this reader does not know: refused, naming the method.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

SCALE_SUFFIX = "_scale_inv"
BLOCKS, MX_SCALES = "_blocks", "_scales"
QUANTIZATION = "quantization_config"
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of an FP4 E2M1 nibble."""
MX_GROUP = 32

Index = Sequence[torch.Tensor | None] | None
Read = Callable[[str, Sequence[torch.Tensor | None]], torch.Tensor]


@dataclass(frozen=True)
class Quantized:
    """How one checkpoint's quantized weights are stored: read by ``SliceReader`` as the weights they stand for."""

    method: str
    """``fp8`` or ``mxfp4``."""
    parts: Mapping[str, tuple[str, ...]]
    """Each weight the checkpoint stands for -> its stored tensors (FP8: the weight and its scales; MXFP4: blocks and
    scales)."""
    shapes: Mapping[str, tuple[int, ...]]
    """Each such weight's shape (in memory's order)."""
    block: tuple[int, int] = (1, 1)
    """FP8: rows and columns of one scale's block (``weight_block_size``)."""

    def read(self, key: str, index: Index, read: Read) -> torch.Tensor:
        """The positions ``index`` of weight ``key`` in float32; ``read(stored, positions)`` reads stored tensors."""
        shape = self.shapes[key]
        positions = [torch.arange(n) if p is None else p for n, p in zip(shape, index or [None] * len(shape))]
        if self.method == "fp8":
            weight, scales = self.parts[key]
            value = read(weight, positions).to(torch.float32)
            return value * read(scales, [p // b for p, b in zip(positions, self.block, strict=True)]).float()
        blocks, scales = self.parts[key]
        experts, columns, rows = positions  # (memory: [experts, in, out]; stored by out, then groups of in)
        groups = torch.unique(columns // MX_GROUP)
        data = read(blocks, [experts, rows, groups, None]).to(torch.uint8)
        lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
        values = torch.stack([lut[(data & 0x0F).long()], lut[(data >> 4).long()]], dim=-1).flatten(-2)
        exponents = read(scales, [experts, rows, groups]).to(torch.int32) - 127
        values = torch.ldexp(values, exponents[..., None]).flatten(-2)  # [experts, rows, groups x 32]
        picked = torch.searchsorted(groups, columns // MX_GROUP) * MX_GROUP + columns % MX_GROUP
        return values[:, :, picked].transpose(1, 2)


def quantization_problem(config: Mapping[str, Any]) -> str | None:
    """Why titanium cannot read the weights of the checkpoint whose ``config.json`` is ``config``: a quantization
    other than block-wise FP8 and MXFP4; None when it can."""
    quantization = config.get(QUANTIZATION)
    if not quantization:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, Mapping) else None
    block = quantization.get("weight_block_size") if isinstance(quantization, Mapping) else None
    if method == "mxfp4" or (method == "fp8" and isinstance(block, Sequence) and len(block) == 2):
        return None
    described = f"quant_method {method!r}" + (f" without a 2-D weight_block_size ({block})" if method == "fp8" else "")
    return (
        f"{QUANTIZATION} has {described}; titanium reads block-wise FP8 (quant_method fp8 with weight_block_size "
        "[rows, cols]) and MXFP4 checkpoints only: start from the model's unquantized (bf16) checkpoint"
    )


def quantized(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> Quantized | None:
    """How the checkpoint whose ``config.json`` is ``config`` and whose tensors have ``shapes`` stores its quantized
    weights; None when it is not quantized (``quantization_problem`` has refused the rest). ``ValueError`` for stored
    tensors without their partner."""
    quantization = config.get(QUANTIZATION)
    if not quantization:
        return None
    if quantization["quant_method"] == "fp8":
        scales = {key.removesuffix(SCALE_SUFFIX): key for key in shapes if key.endswith(SCALE_SUFFIX)}
        unpaired = sorted(weight for weight in scales if weight not in shapes)
        if unpaired:
            raise ValueError(f"scales without their weights: {', '.join(unpaired[:4])}")
        parts = {weight: (weight, scale) for weight, scale in scales.items()}
        block = quantization["weight_block_size"]
        return Quantized("fp8", parts, {key: shapes[key] for key in parts}, (int(block[0]), int(block[1])))
    weights = {key.removesuffix(BLOCKS) for key in shapes if key.endswith(BLOCKS)}
    unpaired = sorted(weight for weight in weights if weight + MX_SCALES not in shapes)
    if unpaired:
        raise ValueError(f"MXFP4 blocks without their scales: {', '.join(unpaired[:4])}")
    parts = {weight: (weight + BLOCKS, weight + MX_SCALES) for weight in weights}
    memory = {}
    for weight in weights:
        experts, out, groups, width = shapes[weight + BLOCKS]
        memory[weight] = (experts, groups * width * 2, out)
    return Quantized("mxfp4", parts, memory)
