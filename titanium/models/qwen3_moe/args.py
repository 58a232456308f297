"""Qwen3-MoE hyperparameters and the published size presets ("flavors").

The attention is Qwen3's; the feed-forward of every ``decoder_sparse_step``-th layer not listed in
``mlp_only_layers`` is a Mixture of Experts (softmax router, top-k, no shared expert), the others keep a
SwiGLU of width ``ffn_dim``. The presets copy the ``config.json`` of ``Qwen/Qwen3-30B-A3B`` and
``Qwen/Qwen3-235B-A22B``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titanium.models.common.decoder import DecoderArgs
from titanium.models.common.moe import MoEArgs
from titanium.models.qwen3.args import Qwen3Args


@dataclass(frozen=True)
class Qwen3MoeArgs(Qwen3Args):
    """Qwen3's arguments plus the experts' (the defaults are the published checkpoints')."""

    num_experts: int = 128
    top_k: int = 8
    """Experts per token (Hugging Face ``num_experts_per_tok``)."""
    moe_dim: int = 768
    """Hidden width of each expert (``moe_intermediate_size``)."""
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    """Every this-many-th layer (1-based) is an MoE layer, unless listed in ``mlp_only_layers``."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers (0-based) that keep a dense SwiGLU of width ``ffn_dim``."""
    router_aux_loss_coef: float = 0.001
    """Weight of the auxiliary load-balancing loss (when ``[moe] load_balance = "aux_loss"``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        outside = [layer for layer in self.mlp_only_layers if not 0 <= layer < self.n_layers]
        if outside:
            raise ValueError(f"mlp_only_layers {outside} are not layers of a {self.n_layers}-layer model")
        self.moe_args()  # (checks top_k against num_experts)

    def moe_args(self) -> MoEArgs:
        return MoEArgs(
            num_experts=self.num_experts, top_k=self.top_k, expert_dim=self.moe_dim, norm_topk_prob=self.norm_topk_prob
        )

    def moe_layer_ids(self) -> frozenset[int]:
        """The layers whose feed-forward is an MoE (Hugging Face's ``Qwen3MoeDecoderLayer`` rule)."""
        return frozenset(
            layer
            for layer in range(self.n_layers)
            if layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )

    def decoder_args(self) -> DecoderArgs:
        return dataclasses.replace(super().decoder_args(), moe=self.moe_args(), moe_layers=self.moe_layer_ids())


QWEN3_MOE_FLAVORS: dict[str, Qwen3MoeArgs] = {
    "debugmodel_moe": Qwen3MoeArgs(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, ffn_dim=768, vocab_size=2256,
        max_seq_len=2048, num_experts=8, top_k=2, moe_dim=256,
    ),
    "30B-A3B": Qwen3MoeArgs(
        dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, ffn_dim=6144, max_seq_len=40960,
        num_experts=128, top_k=8, moe_dim=768,
    ),
    "235B-A22B": Qwen3MoeArgs(
        dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128, ffn_dim=12288, max_seq_len=40960,
        num_experts=128, top_k=8, moe_dim=1536,
    ),
}  # fmt: skip
