"""Qwen3-MoE decoder: the shared decoder built from ``Qwen3MoeArgs`` (MoE feed-forwards in its MoE layers)."""

from __future__ import annotations

from titanium.models.common.decoder import Decoder
from titanium.models.qwen3_moe.args import Qwen3MoeArgs


class Qwen3MoeTransformer(Decoder):
    """Qwen3-MoE language model: ``tokens [B, S] -> logits [B, S, vocab_size]`` (float32)."""

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__(args.decoder_args())
