"""Qwen3 dense <-> Hugging Face ``Qwen3ForCausalLM``: Llama's names plus the per-head q/k norms.

The q/k norm weights act on a head's ``head_dim`` entries before RoPE, so they get the same
interleaved <-> rotate-half permutation as the rows of ``wq``/``wk``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from titanium.models.hf_adapter import HFAdapter, HFConfigError, hf_config_value, rope_config
from titanium.models.llama3.hf import LLAMA_LAYER_KEYS, LLAMA_TOP_KEYS, ROPE_PROJECTIONS
from titanium.models.qwen3.args import Qwen3Args

QWEN3_LAYER_KEYS = {
    **LLAMA_LAYER_KEYS,
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}


@dataclasses.dataclass(frozen=True)
class Qwen3HFAdapter(HFAdapter):
    def unsupported(self, config: Mapping[str, Any]) -> list[str]:
        problems = super().unsupported(config)
        if config.get("use_sliding_window"):
            problems.append("use_sliding_window = true is not supported")
        return problems

    def from_hf_config(self, config: Mapping[str, Any], **overrides: Any) -> Qwen3Args:
        problems = self.unsupported(config)
        theta, scaling = rope_config(config)
        if scaling is not None:
            problems.append(f"RoPE scaling {scaling} is not supported")
        if problems:
            raise HFConfigError("; ".join(problems))
        args = Qwen3Args(
            dim=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=config["num_attention_heads"],
            n_kv_heads=hf_config_value(config, "num_key_value_heads"),
            head_dim=hf_config_value(config, "head_dim"),
            ffn_dim=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=1_000_000.0 if theta is None else theta,
            max_seq_len=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=hf_config_value(config, "tie_word_embeddings"),
        )
        return dataclasses.replace(args, **overrides)

    def to_hf_config(self, args: Qwen3Args) -> dict[str, Any]:
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": args.dim,
            "intermediate_size": args.ffn_dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.head_dim,
            "vocab_size": args.vocab_size,
            "max_position_embeddings": args.max_seq_len,
            "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "rope_scaling": None,
            "tie_word_embeddings": args.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": args.n_layers,
            "initializer_range": 0.02,
            "use_cache": True,
        }


QWEN3_HF_ADAPTER = Qwen3HFAdapter(
    model_type="qwen3",
    layer_keys=QWEN3_LAYER_KEYS,
    top_keys=LLAMA_TOP_KEYS,
    rope_keys=ROPE_PROJECTIONS | {"attention.q_norm.weight", "attention.k_norm.weight"},
)
