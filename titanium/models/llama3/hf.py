"""Llama 3 <-> Hugging Face ``LlamaForCausalLM``: parameter names, RoPE layout and ``config.json``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from titanium.models.common.rope import RopeScaling
from titanium.models.hf_adapter import HFAdapter, HFConfigError, hf_config_value, rope_config, scaling_to_hf
from titanium.models.llama3.args import Llama3Args

LLAMA_LAYER_KEYS = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
LLAMA_TOP_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_PROJECTIONS = frozenset({"attention.wq.weight", "attention.wk.weight"})


def scaling_from_hf(scaling: Mapping[str, Any] | None) -> RopeScaling | None:
    if scaling is None:
        return None
    if scaling.get("rope_type") != "llama3":
        raise HFConfigError(f"RoPE scaling {dict(scaling)} is not supported (only rope_type 'llama3')")
    return RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


@dataclasses.dataclass(frozen=True)
class Llama3HFAdapter(HFAdapter):
    def from_hf_config(self, config: Mapping[str, Any], **overrides: Any) -> Llama3Args:
        problems = self.unsupported(config)
        head_dim = hf_config_value(config, "head_dim")
        if head_dim != config["hidden_size"] // config["num_attention_heads"]:
            problems.append(f"head_dim {head_dim} != hidden_size / num_attention_heads (Llama 3 ties them)")
        if problems:
            raise HFConfigError("; ".join(problems))
        theta, scaling = rope_config(config)
        args = Llama3Args(
            dim=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=config["num_attention_heads"],
            n_kv_heads=hf_config_value(config, "num_key_value_heads"),
            vocab_size=config["vocab_size"],
            ffn_hidden_dim=config["intermediate_size"],
            norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            rope_theta=500000.0 if theta is None else theta,
            rope_scaling=scaling_from_hf(scaling),
            max_seq_len=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf_config_value(config, "tie_word_embeddings"),
        )
        return dataclasses.replace(args, **overrides)

    def to_hf_config(self, args: Llama3Args) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": args.dim,
            "intermediate_size": args.ffn_dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "vocab_size": args.vocab_size,
            "max_position_embeddings": args.max_seq_len,
            "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "rope_scaling": scaling_to_hf(args.rope_scaling),
            "tie_word_embeddings": args.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
        }


LLAMA3_HF_ADAPTER = Llama3HFAdapter(
    model_type="llama",
    layer_keys=LLAMA_LAYER_KEYS,
    top_keys=LLAMA_TOP_KEYS,
    rope_keys=ROPE_PROJECTIONS,
)
