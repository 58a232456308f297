"""Llama 3 hyperparameters and the published size presets ("flavors")."""

from __future__ import annotations

from dataclasses import dataclass

from titanium.models.common.decoder import DecoderArgs
from titanium.models.common.feed_forward import llama_ffn_hidden_dim
from titanium.models.common.rope import RopeScaling


@dataclass(frozen=True)
class Llama3Args:
    """Architecture of a Llama 3 model.

    Frozen because the flavor presets are shared module-level objects: the trainer derives
    its own copy with ``dataclasses.replace`` (see ``titanium.models.build_model_args``)
    instead of mutating a preset.
    """

    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    n_kv_heads: int | None = None
    """None means n_heads (plain multi-head attention)."""
    multiple_of: int = 256
    """The SwiGLU hidden width is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    ffn_hidden_dim: int | None = None
    """Explicit SwiGLU hidden width (Hugging Face ``intermediate_size``); None derives it from
    ``dim``, ``multiple_of`` and ``ffn_dim_multiplier`` as Meta's code does."""
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    """Llama 3.1 frequency scaling; None for plain RoPE."""
    max_seq_len: int = 2048
    """Length of the RoPE tables, i.e. the longest sequence (or largest position) accepted."""
    tie_word_embeddings: bool = False
    """Share the input embedding matrix with the output projection (Llama 3.2 1B/3B)."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.n_heads % self.kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.kv_heads})")
        if self.ffn_hidden_dim is not None and self.ffn_hidden_dim <= 0:
            raise ValueError(f"ffn_hidden_dim must be positive, got {self.ffn_hidden_dim}")
        for name in ("n_layers", "vocab_size", "multiple_of", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        """Hidden width of the SwiGLU blocks."""
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        return llama_ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)

    @property
    def kv_heads(self) -> int:
        """``n_kv_heads`` with the None default resolved."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def decoder_args(self) -> DecoderArgs:
        """The shared decoder's arguments (Llama has no q/k norm)."""
        return DecoderArgs(
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            ffn_dim=self.ffn_dim,
            vocab_size=self.vocab_size,
            norm_eps=self.norm_eps,
            rope_theta=self.rope_theta,
            max_seq_len=self.max_seq_len,
            rope_scaling=self.rope_scaling,
            tie_word_embeddings=self.tie_word_embeddings,
        )


_LLAMA_3_1_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_LLAMA_3_2_SCALING = RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

LLAMA3_FLAVORS: dict[str, Llama3Args] = {
    "debugmodel": Llama3Args(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=4,
        vocab_size=2256,
        multiple_of=256,
        rope_theta=500000.0,
        rope_scaling=_LLAMA_3_1_SCALING,
        max_seq_len=2048,
    ),
    "1B": Llama3Args(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=256,
        ffn_dim_multiplier=1.5,
        rope_scaling=_LLAMA_3_2_SCALING,
        max_seq_len=131072,
        tie_word_embeddings=True,
    ),
    "3B": Llama3Args(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=256,
        ffn_dim_multiplier=1.0,
        rope_scaling=_LLAMA_3_2_SCALING,
        max_seq_len=131072,
        tie_word_embeddings=True,
    ),
    "8B": Llama3Args(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        rope_scaling=_LLAMA_3_1_SCALING,
        max_seq_len=131072,
    ),
    "70B": Llama3Args(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        rope_scaling=_LLAMA_3_1_SCALING,
        max_seq_len=131072,
    ),
    "405B": Llama3Args(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.2,
        rope_scaling=_LLAMA_3_1_SCALING,
        max_seq_len=131072,
    ),
}
