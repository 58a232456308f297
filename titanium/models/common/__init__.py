"""Layers shared by the decoder models. Parallelism-agnostic: plain ``nn.Module`` code only."""

from titanium.models.common.attention import Attention
from titanium.models.common.feed_forward import FeedForward, llama_ffn_hidden_dim
from titanium.models.common.norm import RMSNorm
from titanium.models.common.rope import (
    RopeScaling,
    apply_rope,
    precompute_rope_tables,
    rope_inv_freq,
)

__all__ = [
    "Attention",
    "FeedForward",
    "RMSNorm",
    "RopeScaling",
    "apply_rope",
    "llama_ffn_hidden_dim",
    "precompute_rope_tables",
    "rope_inv_freq",
]
