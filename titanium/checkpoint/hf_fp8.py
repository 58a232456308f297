"""Checkpoints published in block-wise FP8 (DeepSeek-V3 and R1, Kimi K2, the Qwen3 ``-FP8`` models), read as the
weights they stand for.

Such a checkpoint's ``config.json`` has ``quantization_config`` ``{"quant_method": "fp8", "weight_block_size": [128,
128]}``; each quantized weight ``W`` is stored as ``float8_e4m3fn`` beside ``W_scale_inv`` (float32, or UE8M0), one
scale per block of rows and columns: the weight is ``W[r, c] * W_scale_inv[r // block_rows, c // block_cols]``, as
``transformers`` dequantizes it where it has no FP8 kernels. titanium trains the dequantized weights (in the run's
parameter dtype), so the reader multiplies each slice a rank reads by the scales of its blocks: the scales'
rows and columns are read at ``positions // block``, one per weight element (``SliceReader.read`` picks repeated
positions out of the box it reads). An export then holds those dequantized weights, and its ``config.json`` no
``quantization_config``.

Other ``quant_method``s (GPTQ, AWQ, bitsandbytes, MXFP4...) store integers whose meaning this reader does not know:
refused, naming the method.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

SCALE_SUFFIX = "_scale_inv"
QUANTIZATION = "quantization_config"


@dataclass(frozen=True)
class BlockScales:
    """The block-wise FP8 scales of one checkpoint: which of its weights are quantized, where their scales lie."""

    block: tuple[int, int]
    """Rows and columns of one scale's block (``weight_block_size``)."""
    scale_of: Mapping[str, str]
    """Quantized weight -> its scale tensor (``...weight`` -> ``...weight_scale_inv``)."""
    shapes: Mapping[str, tuple[int, ...]]
    """Each quantized weight's shape."""

    def dequantize(
        self,
        key: str,
        value: torch.Tensor,
        index: Sequence[torch.Tensor | None] | None,
        read: Callable[[str, Sequence[torch.Tensor]], torch.Tensor],
    ) -> torch.Tensor:
        """``value``, the positions ``index`` of quantized weight ``key``, times its blocks' scales (float32);
        ``read(scale_key, positions)`` reads the scales at those positions."""
        shape = self.shapes[key]
        index = index if index is not None else [None] * len(shape)
        positions = [torch.arange(n) if p is None else p for n, p in zip(shape, index, strict=True)]
        scales = read(self.scale_of[key], [p // b for p, b in zip(positions, self.block, strict=True)])
        return value.to(torch.float32) * scales.to(torch.float32)


def quantization_problem(config: Mapping[str, Any]) -> str | None:
    """Why titanium cannot read the weights of the checkpoint whose ``config.json`` is ``config``: a quantization
    other than block-wise FP8; None when it can (unquantized, or block-wise FP8)."""
    quantization = config.get(QUANTIZATION)
    if not quantization:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, Mapping) else None
    block = quantization.get("weight_block_size") if isinstance(quantization, Mapping) else None
    if method == "fp8" and isinstance(block, Sequence) and len(block) == 2:
        return None
    described = f"quant_method {method!r}" + (f" without a 2-D weight_block_size ({block})" if method == "fp8" else "")
    return (
        f"{QUANTIZATION} has {described}; titanium reads block-wise FP8 checkpoints only (quant_method fp8 with "
        "weight_block_size [rows, cols]): start from the model's unquantized (bf16) checkpoint"
    )


def block_scales(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> BlockScales | None:
    """The scales of the block-wise FP8 checkpoint whose ``config.json`` is ``config`` and whose tensors have
    ``shapes``; None when it is not quantized (``quantization_problem`` has refused the rest). ``ValueError`` for
    scales without their weights."""
    quantization = config.get(QUANTIZATION)
    if not quantization:
        return None
    block = quantization["weight_block_size"]
    scale_of = {key.removesuffix(SCALE_SUFFIX): key for key in shapes if key.endswith(SCALE_SUFFIX)}
    unpaired = sorted(weight for weight in scale_of if weight not in shapes)
    if unpaired:
        raise ValueError(f"scales without their weights: {', '.join(unpaired[:4])}")
    return BlockScales((int(block[0]), int(block[1])), scale_of, {key: shapes[key] for key in scale_of})
