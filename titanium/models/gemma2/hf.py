"""Gemma 2 <-> Hugging Face ``Gemma2ForCausalLM``: four norms per block, soft-capping, alternating windows.

Names: ``input_layernorm`` / ``post_attention_layernorm`` / ``pre_feedforward_layernorm`` /
``post_feedforward_layernorm`` are our ``attention_norm`` / ``post_attention_norm`` / ``ffn_norm`` /
``post_ffn_norm`` (note: in Llama's checkpoints ``post_attention_layernorm`` is the pre-MLP norm). The norm
weights are stored as ``w`` of ``1 + w``, as ours are, so they load unchanged.

The architecture's particulars must be stated, not guessed: a config without ``query_pre_attn_scalar``, without
either soft-capping value, or with ``hidden_activation`` other than tanh-approximate GELU, ``attention_bias`` or
bidirectional attention is refused, naming the field. Which layers slide comes from ``layer_types``
(transformers 5), else Gemma 2's alternation (even layers slide).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from titanium.models.common.decoder import DecoderArgs
from titanium.models.decoder_adapter import DecoderHFAdapter
from titanium.models.llama3.hf import LLAMA_LAYER_KEYS, LLAMA_TOP_KEYS, ROPE_PROJECTIONS

GEMMA2_LAYER_KEYS = {
    **{ours: hf for ours, hf in LLAMA_LAYER_KEYS.items() if not ours.endswith("norm.weight")},
    "attention_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
}
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
"""``transformers``' names of tanh-approximate GELU."""
SOFTCAPS = {
    "attn_logit_softcapping": "caps its attention logits (50.0 in the published checkpoints)",
    "final_logit_softcapping": "caps its output logits (30.0 in the published checkpoints)",
}


def layer_types(config: Mapping[str, Any]) -> list[str]:
    """Each layer's attention, ``sliding_attention`` or ``full_attention``."""
    types = config.get("layer_types")
    if types is None:
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config["num_hidden_layers"])]
    return list(types)


@dataclasses.dataclass(frozen=True)
class Gemma2HFAdapter(DecoderHFAdapter):
    def unsupported(self, config: Mapping[str, Any]) -> list[str]:
        problems = [p for p in super().unsupported(config) if not p.startswith("hidden_act")]
        activation = config.get("hidden_activation", config.get("hidden_act"))
        if activation not in GELU_TANH:
            problems.append(f"hidden_activation {activation!r} is not supported (Gemma 2's GeGLU: 'gelu_pytorch_tanh')")
        if config.get("query_pre_attn_scalar") is None:
            problems.append("query_pre_attn_scalar is missing (Gemma 2 scales queries by its inverse square root)")
        for name, what in SOFTCAPS.items():
            if config.get(name) is None:
                problems.append(f"{name} is missing or null: Gemma 2 {what}; state it in config.json")
        if config.get("use_bidirectional_attention"):
            problems.append("use_bidirectional_attention = true is not supported (causal attention only)")
        types = layer_types(config)
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown or len(types) != config.get("num_hidden_layers"):
            problems.append(f"layer_types {types} must name sliding_attention or full_attention for every layer")
        return problems

    def args_from_config(self, config: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "norm_unit_offset": True,
            "post_norms": True,
            "activation": "gelu_tanh",
            "scale_embeddings": True,
            "query_pre_attn_scalar": config["query_pre_attn_scalar"],
            "attn_logit_softcap": float(config["attn_logit_softcapping"]),
            "final_logit_softcap": float(config["final_logit_softcapping"]),
            "sliding_window": config.get("sliding_window"),
            "global_layers": tuple(i for i, kind in enumerate(layer_types(config)) if kind == "full_attention"),
        }

    def config_from_args(self, args: DecoderArgs) -> dict[str, Any]:
        return {
            "hidden_activation": "gelu_pytorch_tanh",
            "attention_bias": False,
            "query_pre_attn_scalar": args.query_pre_attn_scalar,
            "attn_logit_softcapping": args.attn_logit_softcap,
            "final_logit_softcapping": args.final_logit_softcap,
            "sliding_window": args.sliding_window,
            "layer_types": [
                "full_attention" if i in args.global_layers else "sliding_attention" for i in range(args.n_layers)
            ],
        }


GEMMA2_HF_ADAPTER = Gemma2HFAdapter(
    model_type="gemma2",
    layer_keys=GEMMA2_LAYER_KEYS,
    top_keys=LLAMA_TOP_KEYS,
    rope_keys=ROPE_PROJECTIONS,
    architecture="Gemma2ForCausalLM",
    defaults={"rope_theta": 10_000.0, "norm_eps": 1e-6, "max_seq_len": 8192, "tie_word_embeddings": True},
)
