"""Parameter and FLOP counting for decoder language models (feeds MFU reporting)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from titanium.models.common.decoder import Decoder
from titanium.models.common.moe import moe_layers


def count_params(model: nn.Module, exclude_embedding: bool = False, active_only: bool = False) -> int:
    """Number of distinct parameters; works on meta-device models (reads shapes only).

    With ``exclude_embedding``, input embedding tables (``nn.Embedding`` weights) are left
    out, because a lookup costs no FLOPs. A table tied to an output projection is still
    counted once, since as the projection it does a full matmul per token. With ``active_only``,
    the routed experts of each MoE layer count ``top_k / num_experts`` of their size: the
    parameters one token computes with.
    """
    params = {id(p): p for p in model.parameters()}
    routed = 0.0
    if active_only:
        for moe in moe_layers(model).values():
            for p in moe.experts.parameters():
                params.pop(id(p), None)
                routed += p.numel() * moe.args.top_k / moe.args.num_experts
    if exclude_embedding:
        used_elsewhere = {
            id(p)
            for module in model.modules()
            if not isinstance(module, nn.Embedding)
            for p in module.parameters(recurse=False)
        }
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                for p in module.parameters(recurse=False):
                    if id(p) not in used_elsewhere:
                        params.pop(id(p), None)
    return sum(p.numel() for p in params.values()) + round(routed)


def decoder_flops_per_token(
    num_nonembedding_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int
) -> float:
    """Training FLOPs per token: ``6 * N + 12 * n_layers * n_heads * head_dim * seq_len``.

    ``6 N`` is forward (2) plus backward (4) for every weight matmul; the second term is the
    attention score and value matmuls, counted without the causal discount (the PaLM
    appendix B convention, also torchtitan's), so MFU numbers are comparable to theirs.
    """
    return 6.0 * num_nonembedding_params + 12.0 * n_layers * n_heads * head_dim * seq_len


def count_params_on_meta(
    model_cls: Callable[[Any], nn.Module], args: Any, exclude_embedding: bool = False, active_only: bool = False
) -> int:
    """Build ``model_cls(args)`` on the meta device and count its parameters.

    Counting a real module (rather than a hand-written formula) keeps the count in sync with
    the architecture, and the meta device makes it free even for a 405B model.
    """
    with torch.device("meta"):
        model = model_cls(args)
    return count_params(model, exclude_embedding=exclude_embedding, active_only=active_only)


def decoder_model_flops_per_token(args: Any, seq_len: int) -> float:
    """Training FLOPs per token of the shared ``Decoder`` built from ``args`` (any family's; see
    ``decoder_flops_per_token``), on the parameters a token computes with (an MoE layer counts ``top_k`` of its
    experts). Sliding-window layers are counted as global ones, as MFU conventions do."""
    d = args.decoder_args()
    num_params = count_params_on_meta(Decoder, d, exclude_embedding=True, active_only=True)
    return decoder_flops_per_token(num_params, d.n_layers, d.n_heads, d.head_dim, seq_len)
