"""Phi-3 and Phi-4 sizes ("flavors"): the shared decoder at Llama's settings.

SwiGLU, RMSNorm eps 1e-5, untied embeddings, ``head_dim = dim / n_heads``; what differs is the checkpoint layout
(fused ``qkv_proj`` and ``gate_up_proj``, see ``hf.py``). Phi-3 mini and medium (4k context) slide a 2047-token
window over every layer; Phi-4 attends globally with RoPE theta 250,000.
"""

from __future__ import annotations

from functools import partial

from titanium.models.common.decoder import DecoderArgs

_phi3 = partial(
    DecoderArgs, norm_eps=1e-5, rope_theta=10_000.0, vocab_size=32064, max_seq_len=4096, sliding_window=2047
)

PHI3_FLAVORS: dict[str, DecoderArgs] = {
    "debugmodel": _phi3(
        dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=32, ffn_dim=768, vocab_size=2256, max_seq_len=2048,
        sliding_window=None,
    ),
    "mini": _phi3(dim=3072, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=96, ffn_dim=8192),
    "medium": _phi3(dim=5120, n_layers=40, n_heads=40, n_kv_heads=10, head_dim=128, ffn_dim=17920),
    "phi4-14B": _phi3(
        dim=5120, n_layers=40, n_heads=40, n_kv_heads=10, head_dim=128, ffn_dim=17920, vocab_size=100352,
        rope_theta=250_000.0, max_seq_len=16384, sliding_window=None,
    ),
}  # fmt: skip
