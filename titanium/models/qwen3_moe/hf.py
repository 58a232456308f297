"""Qwen3-MoE <-> Hugging Face ``Qwen3MoeForCausalLM``: Qwen3's names plus the router and per-expert weights.

On disk (``save_pretrained``) transformers keeps one tensor per expert and projection,
``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``; ours are stacked ``[num_experts, ...]``
(``w1`` = gate, ``w3`` = up, ``w2`` = down), so loading stacks and exporting splits them. The format has no
slot for the aux-loss-free routing bias (``moe.expert_bias``): see ``HFAdapter.no_hf_slot``.

``config.json`` gives a loaded model its whole shape, the layer placement (``decoder_sparse_step``,
``mlp_only_layers``) and router settings (``norm_topk_prob``, ``router_aux_loss_coef``) included. Features of
other MoE families (shared experts, sigmoid or group-limited routing, dense first layers) are refused by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from titanium.models.hf_adapter import hf_config_value
from titanium.models.llama3.hf import LLAMA_TOP_KEYS, ROPE_PROJECTIONS
from titanium.models.qwen3.hf import QWEN3_LAYER_KEYS, Qwen3HFAdapter
from titanium.models.qwen3_moe.args import Qwen3MoeArgs

QWEN3_MOE_LAYER_KEYS = {**QWEN3_LAYER_KEYS, "moe.router.gate.weight": "mlp.gate.weight"}
QWEN3_MOE_EXPERT_KEYS = {
    "moe.experts.w1": "mlp.experts.{e}.gate_proj.weight",
    "moe.experts.w2": "mlp.experts.{e}.down_proj.weight",
    "moe.experts.w3": "mlp.experts.{e}.up_proj.weight",
}

_FOREIGN_FEATURES = {
    # config.json key -> (the value that means "absent", what it is)
    "shared_expert_intermediate_size": (0, "shared experts (Qwen2-MoE)"),
    "n_shared_experts": (0, "shared experts"),
    "first_k_dense_replace": (0, "dense first layers (DeepSeek)"),
    "n_group": (1, "group-limited routing"),
    "topk_group": (1, "group-limited routing"),
    "routed_scaling_factor": (1.0, "a routed scaling factor"),
    "scoring_func": ("softmax", "a non-softmax router"),
}

_FROM_CHECKPOINT = ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef")
"""Args a loaded checkpoint's config.json decides whatever the flavor says."""


def _moe_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "num_experts": hf_config_value(config, "num_experts"),
        "top_k": config.get("num_experts_per_tok"),
        "moe_dim": config.get("moe_intermediate_size"),
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "decoder_sparse_step": config.get("decoder_sparse_step", 1),
        "mlp_only_layers": tuple(config.get("mlp_only_layers") or ()),
        "router_aux_loss_coef": float(config.get("router_aux_loss_coef", 0.001)),
    }


@dataclasses.dataclass(frozen=True)
class Qwen3MoeHFAdapter(Qwen3HFAdapter):
    def unsupported(self, config: Mapping[str, Any]) -> list[str]:
        problems = super().unsupported(config)
        for key, (absent, what) in _FOREIGN_FEATURES.items():
            value = config.get(key)
            if value is not None and value != absent:
                problems.append(f"{key} = {value!r} ({what}) is not part of Qwen3-MoE")
        moe = _moe_fields(config)
        for key, ours in (("num_experts", "num_experts"), ("num_experts_per_tok", "top_k")):
            if not isinstance(moe[ours], int) or moe[ours] < 1:
                problems.append(f"{key} must be a positive integer, got {moe[ours]!r}")
        if not isinstance(moe["moe_dim"], int) or moe["moe_dim"] < 1:
            problems.append(f"moe_intermediate_size must be a positive integer, got {moe['moe_dim']!r}")
        if isinstance(moe["num_experts"], int) and isinstance(moe["top_k"], int) and moe["top_k"] > moe["num_experts"]:
            problems.append(
                f"num_experts_per_tok {moe['top_k']} is larger than num_experts {moe['num_experts']}: "
                "a token cannot pick more experts than there are"
            )
        step = moe["decoder_sparse_step"]
        if not isinstance(step, int) or step < 1:
            problems.append(f"decoder_sparse_step must be an integer >= 1, got {step!r}")
        layers = config.get("num_hidden_layers", 0)
        outside = [layer for layer in moe["mlp_only_layers"] if not (isinstance(layer, int) and 0 <= layer < layers)]
        if outside:
            problems.append(f"mlp_only_layers {outside} are not layers 0..{layers - 1}")
        return problems

    def from_hf_config(self, config: Mapping[str, Any], **overrides: Any) -> Qwen3MoeArgs:
        dense = super().from_hf_config(config)  # (raises HFConfigError listing every unsupported feature)
        fields = {f.name: getattr(dense, f.name) for f in dataclasses.fields(dense)}
        return dataclasses.replace(Qwen3MoeArgs(**fields, **_moe_fields(config)), **overrides)

    def checkpoint_overrides(self, config: Mapping[str, Any]) -> dict[str, Any]:
        moe = _moe_fields(config)
        return {name: moe[name] for name in _FROM_CHECKPOINT}

    def config_fields(self, args: Qwen3MoeArgs) -> dict[str, tuple[str, Any]]:
        return {
            **super().config_fields(args),
            "num_experts": ("num_experts", args.num_experts),
            "num_experts_per_tok": ("top_k", args.top_k),
            "moe_intermediate_size": ("moe_dim", args.moe_dim),
        }

    def to_hf_config(self, args: Qwen3MoeArgs) -> dict[str, Any]:
        return {
            **super().to_hf_config(args),
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": args.num_experts,
            "num_experts_per_tok": args.top_k,
            "moe_intermediate_size": args.moe_dim,
            "norm_topk_prob": args.norm_topk_prob,
            "decoder_sparse_step": args.decoder_sparse_step,
            "mlp_only_layers": list(args.mlp_only_layers),
            "router_aux_loss_coef": args.router_aux_loss_coef,
            "output_router_logits": False,
        }


QWEN3_MOE_HF_ADAPTER = Qwen3MoeHFAdapter(
    model_type="qwen3_moe",
    layer_keys=QWEN3_MOE_LAYER_KEYS,
    top_keys=LLAMA_TOP_KEYS,
    rope_keys=ROPE_PROJECTIONS | {"attention.q_norm.weight", "attention.k_norm.weight"},
    expert_keys=QWEN3_MOE_EXPERT_KEYS,
    no_hf_slot=frozenset({"moe.expert_bias"}),
    # transformers 5's Qwen3MoeExperts: gate_up_proj [E, 2F, D] (gate rows, then up), down_proj [E, D, F]
    memory_expert_params={
        "moe.experts.w1": ("mlp.experts.gate_up_proj", 0),
        "moe.experts.w3": ("mlp.experts.gate_up_proj", 1),
        "moe.experts.w2": ("mlp.experts.down_proj", 0),
    },
)
