"""RMSNorm, in the two styles of the published checkpoints."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale.

    Normalisation runs in float32 whatever the activation dtype (bf16 has too few mantissa bits for a mean of
    squares). Llama style (default): the result is cast back before the scale ``w`` is applied, the order of the
    Meta and Hugging Face Llama code. ``unit_offset`` (Gemma): the scale is ``1 + w`` (``w`` starts at zero) and
    is applied in float32 before the cast, Gemma's order. Either way checkpoints reproduce their own numerics,
    and the output keeps the input's dtype even when the weight is float32.
    """

    def __init__(self, dim: int, eps: float = 1e-5, unit_offset: bool = False) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (self.dim,), eps=self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return normed.type_as(x) * self.weight.to(x.dtype)

    def reset_parameters(self) -> None:
        """A scale of one, i.e. start as a pure normalisation."""
        if self.unit_offset:
            nn.init.zeros_(self.weight)
        else:
            nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}" + (", unit_offset=True" if self.unit_offset else "")
