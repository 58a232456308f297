"""Qwen2 / Qwen2.5 sizes ("flavors"): the shared decoder with biases on the q/k/v projections.

The presets copy the ``config.json`` of the published ``Qwen/Qwen2.5-*`` checkpoints (Qwen2 0.5B, 1.5B, 7B and
72B have the same shapes). The three small sizes tie their embeddings; from 7B on the vocabulary is padded to
152,064 rows.
"""

from __future__ import annotations

from functools import partial

from titanium.models.common.decoder import DecoderArgs

_qwen2 = partial(
    DecoderArgs, norm_eps=1e-6, rope_theta=1_000_000.0, attention_bias=True, vocab_size=151936, max_seq_len=32768
)
_small = partial(_qwen2, tie_word_embeddings=True)
_large = partial(_qwen2, vocab_size=152064, max_seq_len=131072, head_dim=128)

QWEN2_FLAVORS: dict[str, DecoderArgs] = {
    "debugmodel": _qwen2(
        dim=256, n_layers=6, n_heads=8, n_kv_heads=2, head_dim=32, ffn_dim=768, vocab_size=2256, max_seq_len=2048,
        tie_word_embeddings=True,
    ),
    "0.5B": _small(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64, ffn_dim=4864),
    "1.5B": _small(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128, ffn_dim=8960),
    "3B": _small(dim=2048, n_layers=36, n_heads=16, n_kv_heads=2, head_dim=128, ffn_dim=11008),
    "7B": _large(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_dim=18944),
    "14B": _large(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, ffn_dim=13824),
    "32B": _large(dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, ffn_dim=27648),
    "72B": _large(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=29568),
}  # fmt: skip
