"""Qwen3 dense decoder: Llama 3's decoder built from ``Qwen3Args``.

The two differences live in the args: per-head QK-RMSNorm before RoPE (``qk_norm_eps``) and a free
``head_dim``. Parameter names match Llama's plus ``attention.q_norm`` / ``attention.k_norm``, so
Llama's tensor-parallel plan applies as is.
"""

from __future__ import annotations

from titanium.models.llama3.model import Transformer
from titanium.models.qwen3.args import Qwen3Args


class Qwen3Transformer(Transformer):
    """Qwen3 language model: ``tokens [B, S] -> logits [B, S, vocab_size]`` (float32)."""

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__(args)
