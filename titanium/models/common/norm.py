"""RMSNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale.

    Normalisation runs in float32 whatever the activation dtype (bf16 has too few mantissa
    bits for a mean of squares); the result is cast back before the scale is applied, which
    is the order of the Meta and Hugging Face Llama code, so checkpoints reproduce their
    numerics. The output keeps the input's dtype even when the weight is float32.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (self.dim,), eps=self.eps).type_as(x)
        return normed * self.weight.to(x.dtype)

    def reset_parameters(self) -> None:
        """Scale of one, i.e. start as a pure normalisation."""
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
