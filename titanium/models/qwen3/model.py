"""Qwen3 dense decoder: the shared decoder built from ``Qwen3Args``.

The two differences from Llama live in the args: per-head QK-RMSNorm before RoPE (``qk_norm_eps`` of the
decoder args) and a free ``head_dim``. Parameter names match Llama's plus ``attention.q_norm`` /
``attention.k_norm``, so Llama's tensor-parallel plan applies with the norms added.
"""

from __future__ import annotations

from titanium.models.common.decoder import Decoder
from titanium.models.qwen3.args import Qwen3Args


class Qwen3Transformer(Decoder):
    """Qwen3 language model: ``tokens [B, S] -> logits [B, S, vocab_size]`` (float32)."""

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__(args.decoder_args())
