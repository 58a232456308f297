"""QLoRA: the frozen base weights of adapted layers stored as 4-bit NormalFloat (torchao ``NF4Tensor``).

torchao is imported only here, and only when QLoRA is used (it is slow to import). Its NF4 code moved
from ``torchao.dtypes.nf4tensor`` (<= 0.14) to ``torchao.quantization`` (0.15+); both are accepted.
"""

from __future__ import annotations

from typing import Any

import torch

from titanium.errors import UserError

BLOCK_SIZE = 64
"""Weights per NF4 block (one absmax scaler each), torchao's and the QLoRA paper's default."""
SCALER_BLOCK_SIZE = 256
"""Scalers per double-quantization group (torchao's default); smaller where a layer or its FSDP shards need it."""


def _torchao_nf4() -> Any:
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:  # torchao <= 0.14
        from torchao.dtypes import nf4tensor as nf4_tensor
    return nf4_tensor


def linear_nf4(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for an NF4 weight, dequantized block by block in ``x``'s dtype (no weight grad)."""
    return _torchao_nf4().linear_nf4(x, weight)


def is_nf4(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "get_original_weight") and type(tensor).__name__ == "NF4Tensor"


def dequantize(tensor: torch.Tensor) -> torch.Tensor:
    """A dense copy of an NF4 tensor (its original dtype); any other tensor as is."""
    return tensor.get_original_weight() if is_nf4(tensor) else tensor


def to_nf4(weight: torch.Tensor, name: str = "weight", shard_degree: int = 1) -> torch.Tensor:
    """Quantize a dense 2-D weight so that FSDP2 can split it evenly into ``shard_degree`` row chunks.

    torchao splits an NF4 tensor by splitting its blocks and its double-quantization groups, so every
    chunk must hold whole groups: the rows and the group count must divide by ``shard_degree``. The
    group size is the largest power of two <= ``SCALER_BLOCK_SIZE`` that allows it.
    """
    rows, numel = weight.shape[0], weight.numel()
    n_blocks = numel // BLOCK_SIZE
    scaler_block = SCALER_BLOCK_SIZE
    while scaler_block > 1 and n_blocks % (scaler_block * shard_degree):
        scaler_block //= 2
    if numel % BLOCK_SIZE or rows % shard_degree or n_blocks % (scaler_block * shard_degree):
        raise UserError(
            f"--lora.quantize_base nf4: {name} {list(weight.shape)} cannot be stored as NF4 blocks of "
            f"{BLOCK_SIZE} elements split evenly over {shard_degree} data-parallel shard(s); drop this layer "
            "from --lora.target_modules, change --parallelism.data_parallel_shard_degree, or use "
            "--lora.quantize_base none"
        )
    return _torchao_nf4().to_nf4(weight.detach().contiguous(), BLOCK_SIZE, scaler_block)
