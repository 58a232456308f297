"""Qwen2 / Qwen2.5 <-> Hugging Face ``Qwen2ForCausalLM``: Llama's names plus the q/k/v biases.

A bias adds to its projection's output rows, so the q/k biases get the RoPE row permutation of ``wq``/``wk``.
Sliding-window attention (``use_sliding_window``) is off in every published checkpoint; a config that turns it
on is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from titanium.models.common.decoder import DecoderArgs
from titanium.models.decoder_adapter import DecoderHFAdapter
from titanium.models.llama3.hf import LLAMA_LAYER_KEYS, LLAMA_TOP_KEYS, ROPE_PROJECTIONS

BIASES = {f"attention.w{p}.bias": f"self_attn.{p}_proj.bias" for p in "qkv"}


@dataclasses.dataclass(frozen=True)
class Qwen2HFAdapter(DecoderHFAdapter):
    def unsupported(self, config: Mapping[str, Any]) -> list[str]:
        problems = [p for p in super().unsupported(config) if not p.startswith("attention_bias")]
        if config.get("use_sliding_window"):
            problems.append("use_sliding_window = true is not supported (no published Qwen2/2.5 checkpoint uses it)")
        return problems

    def args_from_config(self, config: Mapping[str, Any]) -> dict[str, Any]:
        return {"attention_bias": True}

    def config_from_args(self, args: DecoderArgs) -> dict[str, Any]:
        return {
            "hidden_act": "silu",
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": args.n_layers,
        }


QWEN2_HF_ADAPTER = Qwen2HFAdapter(
    model_type="qwen2",
    layer_keys={**LLAMA_LAYER_KEYS, **BIASES},
    top_keys=LLAMA_TOP_KEYS,
    rope_keys=ROPE_PROJECTIONS | {"attention.wq.bias", "attention.wk.bias"},
    architecture="Qwen2ForCausalLM",
    defaults={"rope_theta": 1_000_000.0, "norm_eps": 1e-6, "max_seq_len": 32768},
)
