"""Rotary position embeddings (RoPE) with real cos/sin tables.

Convention: **interleaved pairs** (Meta's original Llama code). The head dimension is
split into consecutive pairs ``(x[2i], x[2i+1])`` and pair ``i`` is rotated by the angle
``position * inv_freq[i]``. Hugging Face checkpoints use the "rotate half" convention
(pairs ``(x[i], x[i + D/2])``) and store ``wq``/``wk`` with their output rows permuted to
match it, so the HF adapter has to undo that permutation when loading (and redo it when
saving). Nothing else in the model depends on the convention.

The tables are plain float32 tensors rather than Meta's complex ``freqs_cis``: complex
tensors are poorly supported by DTensor, FSDP and ``torch.compile``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 frequency scaling, which stretches the long wavelengths to extend context.

    Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` are
    kept, those longer than ``original_max_position_embeddings / low_freq_factor`` are
    divided by ``factor``, and the band in between is interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"RopeScaling.factor must be positive, got {self.factor}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                "RopeScaling.high_freq_factor must be larger than low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float64) for RoPE, optionally Llama 3.1-scaled.

    Kept separate from the tables so tests can compare it with reference implementations.
    """
    if head_dim % 2 != 0:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq

    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, interpolated)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, scaled)


def precompute_rope_tables(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    scaling: RopeScaling | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(cos, sin)``, each float32 ``[max_seq_len, head_dim // 2]``; row p is position p.

    The angles are formed in float64: in float32, ``position * inv_freq`` loses about 1e-2
    radians at position 131072, which is visible in long-context attention.
    """
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device=device)
    positions = torch.arange(max_seq_len, dtype=torch.float64, device=device)
    angles = torch.outer(positions, inv_freq)
    return angles.cos().float(), angles.sin().float()


def _select_rows(table: torch.Tensor, seq_len: int, positions: torch.Tensor | None) -> torch.Tensor:
    """Rows of ``table`` shaped to broadcast against ``[B, S, H, D/2]``."""
    if positions is None:
        if seq_len > table.shape[0]:
            raise ValueError(
                f"sequence length {seq_len} exceeds the RoPE table length {table.shape[0]}; "
                "raise max_seq_len in the model args"
            )
        return table[:seq_len].view(1, seq_len, 1, -1)
    if positions.shape[-1] != seq_len or positions.dim() not in (1, 2):
        raise ValueError(f"positions must have shape [S] or [B, S] with S={seq_len}, got {tuple(positions.shape)}")
    rows = table[positions]
    if positions.dim() == 1:
        return rows.view(1, seq_len, 1, -1)
    return rows.unsqueeze(2)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs.unbind(-1)
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` and ``k`` (``[B, S, H, D]``, any head counts) by their positions.

    ``positions`` (LongTensor ``[S]`` or ``[B, S]``) picks table rows, so context parallelism
    can pass global offsets and document packing can pass positions that restart at 0;
    by default position ``s`` is row ``s``. The rotation runs in float32 and the result is
    cast back to the input dtype, as in the reference Llama code.
    """
    seq_len = q.shape[1]
    cos = _select_rows(cos, seq_len, positions)
    sin = _select_rows(sin, seq_len, positions)
    return _rotate_pairs(q, cos, sin), _rotate_pairs(k, cos, sin)
