"""Gated feed-forward block: SwiGLU (Llama, Qwen, Mistral, Phi-3) or GeGLU (Gemma)."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

Activation = Literal["silu", "gelu_tanh"]
"""The gate's activation: ``silu`` (SwiGLU) or the tanh approximation of GELU (GeGLU, HF ``gelu_pytorch_tanh``)."""


def llama_ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None = None) -> int:
    """Hidden width of a Llama SwiGLU block.

    Two thirds of the classic ``4 * dim`` keeps the parameter count of a plain MLP despite
    the third matrix; the optional multiplier and the rounding up to ``multiple_of`` (for
    matmul-friendly shapes) reproduce the published Llama sizes exactly.
    """
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class FeedForward(nn.Module):
    """``w2(act(w1 x) * w3 x)`` without biases; ``act`` is SiLU (SwiGLU) or tanh-approximate GELU (GeGLU)."""

    def __init__(self, dim: int, hidden_dim: int, activation: Activation = "silu") -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x)
        gate = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.w2(gate * self.w3(x))

    def init_weights(
        self, out_init_std: float, in_init_std: float = 0.02, generator: torch.Generator | None = None
    ) -> None:
        """``w1`` gets ``in_init_std``; ``w2`` and ``w3`` get the depth-scaled ``out_init_std``.

        Scaling the matrices that feed the residual stream by depth keeps its variance from
        growing with the number of layers. ``w3`` follows ``w2`` as in torchtitan, whose
        loss curves we use as a reference. Truncation is at 3 standard deviations.
        """
        for linear, std in ((self.w1, in_init_std), (self.w2, out_init_std), (self.w3, out_init_std)):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)

    def extra_repr(self) -> str:
        return f"activation={self.activation}"
