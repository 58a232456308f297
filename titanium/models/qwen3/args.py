"""Qwen3 dense hyperparameters and the published size presets ("flavors").

The presets copy the ``config.json`` of the published ``Qwen/Qwen3-*`` checkpoints. Unlike Llama,
``head_dim`` (128) is a free parameter and the SwiGLU width is given explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass

from titanium.models.common.decoder import DecoderArgs


@dataclass(frozen=True)
class Qwen3Args:
    """Architecture of a Qwen3 dense model (frozen: presets are shared; derive with ``replace``)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    """SwiGLU hidden width (Hugging Face ``intermediate_size``)."""
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm, the per-head q/k norms included."""
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 4096
    """Length of the RoPE tables, i.e. the longest sequence (or largest position) accepted."""
    tie_word_embeddings: bool = False
    """Share the input embedding matrix with the output projection (0.6B, 1.7B and 4B do)."""

    def __post_init__(self) -> None:
        self.decoder_args()  # (checks the shape: even head_dim, whole KV groups, positive sizes)

    def decoder_args(self) -> DecoderArgs:
        """The shared decoder's arguments: per-head q/k RMSNorm (with the model's epsilon) before RoPE."""
        return DecoderArgs(
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            ffn_dim=self.ffn_dim,
            vocab_size=self.vocab_size,
            norm_eps=self.norm_eps,
            rope_theta=self.rope_theta,
            max_seq_len=self.max_seq_len,
            qk_norm_eps=self.norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
        )


QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    "debugmodel": Qwen3Args(
        dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=64, ffn_dim=768, vocab_size=2256,
        max_seq_len=2048, tie_word_embeddings=True,
    ),
    "0.6B": Qwen3Args(
        dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072,
        max_seq_len=40960, tie_word_embeddings=True,
    ),
    "1.7B": Qwen3Args(
        dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=6144,
        max_seq_len=40960, tie_word_embeddings=True,
    ),
    "4B": Qwen3Args(
        dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=9728,
        max_seq_len=40960, tie_word_embeddings=True,
    ),
    "8B": Qwen3Args(
        dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=12288, max_seq_len=40960,
    ),
    "14B": Qwen3Args(
        dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, head_dim=128, ffn_dim=17408, max_seq_len=40960,
    ),
    "32B": Qwen3Args(
        dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128, ffn_dim=25600, max_seq_len=40960,
    ),
}  # fmt: skip
