"""Llama 3 (3, 3.1, 3.2 text models): the shared decoder built from ``Llama3Args``.

Parameter names follow Meta's checkpoints, so the HF adapter is a pure renaming plus the RoPE
permutation of ``wq``/``wk``.
"""

from __future__ import annotations

from titanium.models.common.decoder import Decoder
from titanium.models.llama3.args import Llama3Args


class Transformer(Decoder):
    """Llama 3 language model: ``tokens [B, S] -> logits [B, S, vocab_size]`` (float32)."""

    def __init__(self, args: Llama3Args) -> None:
        super().__init__(args.decoder_args())
