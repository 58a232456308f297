"""Qwen3 dense <-> Hugging Face ``Qwen3ForCausalLM``: Llama's names plus the per-head q/k norms.

The q/k norm weights act on a head's ``head_dim`` entries before RoPE, so they get the same
interleaved <-> rotate-half permutation as the rows of ``wq``/``wk``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from titanium.models.decoder_adapter import decoder_config, decoder_fields
from titanium.models.hf_adapter import HFAdapter, HFConfigError, rope_config
from titanium.models.llama3.hf import LLAMA_LAYER_KEYS, LLAMA_TOP_KEYS, ROPE_PROJECTIONS
from titanium.models.qwen3.args import Qwen3Args

QWEN3_DEFAULTS = {"rope_theta": 1_000_000.0, "norm_eps": 1e-6, "max_seq_len": 4096}
"""What ``transformers`` assumes for fields a Qwen3 config.json leaves out."""
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
        scaling = rope_config(config)[1]
        if scaling is not None:
            problems.append(f"RoPE scaling {scaling} is not supported")
        if problems:
            raise HFConfigError("; ".join(problems))
        args = Qwen3Args(**decoder_fields(config, QWEN3_DEFAULTS))
        return dataclasses.replace(args, **overrides)

    def to_hf_config(self, args: Qwen3Args) -> dict[str, Any]:
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            **decoder_config(args.decoder_args()),
            "hidden_act": "silu",
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": args.n_layers,
        }


QWEN3_HF_ADAPTER = Qwen3HFAdapter(
    model_type="qwen3",
    layer_keys=QWEN3_LAYER_KEYS,
    top_keys=LLAMA_TOP_KEYS,
    rope_keys=ROPE_PROJECTIONS | {"attention.q_norm.weight", "attention.k_norm.weight"},
)
