"""Gemma 2 sizes ("flavors"): the shared decoder with every Gemma 2 difference switched on.

RMSNorm scales by ``1 + w``; each block also normalises its attention and MLP outputs (four norms per block);
the MLP is GeGLU with tanh-approximate GELU; embeddings are multiplied by ``sqrt(dim)`` and tied to the output;
attention logits are scaled by ``query_pre_attn_scalar ** -0.5`` and soft-capped at 50, the output logits at
30; even layers attend within a 4096-token sliding window, odd layers globally. The presets copy the
``config.json`` of the published ``google/gemma-2-*`` checkpoints.
"""

from __future__ import annotations

from functools import partial

from titanium.models.common.decoder import DecoderArgs

_gemma2 = partial(
    DecoderArgs,
    vocab_size=256000,
    norm_eps=1e-6,
    rope_theta=10_000.0,
    max_seq_len=8192,
    tie_word_embeddings=True,
    norm_unit_offset=True,
    post_norms=True,
    activation="gelu_tanh",
    scale_embeddings=True,
    query_pre_attn_scalar=256,
    attn_logit_softcap=50.0,
    final_logit_softcap=30.0,
    sliding_window=4096,
)


def _odd(n_layers: int) -> tuple[int, ...]:
    """Gemma 2's global layers: every second one, starting at layer 1."""
    return tuple(range(1, n_layers, 2))


GEMMA2_FLAVORS: dict[str, DecoderArgs] = {
    "debugmodel": _gemma2(
        dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=32, ffn_dim=768, vocab_size=2256, max_seq_len=2048,
        query_pre_attn_scalar=32, sliding_window=512, global_layers=_odd(6),
    ),
    "2B": _gemma2(dim=2304, n_layers=26, n_heads=8, n_kv_heads=4, head_dim=256, ffn_dim=9216, global_layers=_odd(26)),
    "9B": _gemma2(dim=3584, n_layers=42, n_heads=16, n_kv_heads=8, head_dim=256, ffn_dim=14336, global_layers=_odd(42)),
    "27B": _gemma2(
        dim=4608, n_layers=46, n_heads=32, n_kv_heads=16, head_dim=128, ffn_dim=36864, query_pre_attn_scalar=144,
        global_layers=_odd(46),
    ),
}  # fmt: skip
