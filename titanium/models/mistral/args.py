"""Mistral sizes ("flavors"): the shared decoder, with a sliding window in v0.1.

Mistral 7B is Llama's decoder at another shape: 32 layers of width 4096, 8 KV heads, SwiGLU width 14336. The
``7B`` preset is the v0.3 layout (vocabulary 32,768, RoPE theta 1e6, no sliding window); v0.1's 4096-token
sliding window (vocabulary 32,000, theta 1e4) loads from its config.json and runs through the attention mask
paths. Mistral NeMo 12B decouples ``head_dim`` (128) from ``dim / n_heads``.
"""

from __future__ import annotations

from functools import partial

from titanium.models.common.decoder import DecoderArgs

_mistral = partial(DecoderArgs, norm_eps=1e-5, rope_theta=1_000_000.0, head_dim=128, max_seq_len=32768)

MISTRAL_FLAVORS: dict[str, DecoderArgs] = {
    "debugmodel": _mistral(
        dim=256, n_layers=6, n_heads=8, n_kv_heads=2, head_dim=32, ffn_dim=768, vocab_size=2256, max_seq_len=2048
    ),
    "7B": _mistral(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32768),
    "NeMo-12B": _mistral(
        dim=5120, n_layers=40, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=131072, max_seq_len=131072
    ),
}  # fmt: skip
