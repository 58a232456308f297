"""Mistral <-> Hugging Face ``MistralForCausalLM``: Llama's names and RoPE layout, plus the sliding window.

A ``sliding_window`` (v0.1: 4096) applies to every layer; v0.2 and later set it to null.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from titanium.models.common.decoder import DecoderArgs
from titanium.models.decoder_adapter import DecoderHFAdapter
from titanium.models.llama3.hf import LLAMA_LAYER_KEYS, LLAMA_TOP_KEYS, ROPE_PROJECTIONS


@dataclasses.dataclass(frozen=True)
class WindowedHFAdapter(DecoderHFAdapter):
    """A family whose ``sliding_window`` (null: none) applies to every layer (Mistral, Phi-3)."""

    def args_from_config(self, config: Mapping[str, Any]) -> dict[str, Any]:
        return {"sliding_window": config.get("sliding_window")}

    def config_from_args(self, args: DecoderArgs) -> dict[str, Any]:
        return {"hidden_act": "silu", "sliding_window": args.sliding_window}


MISTRAL_HF_ADAPTER = WindowedHFAdapter(
    model_type="mistral",
    layer_keys=LLAMA_LAYER_KEYS,
    top_keys=LLAMA_TOP_KEYS,
    rope_keys=ROPE_PROJECTIONS,
    architecture="MistralForCausalLM",
    defaults={"rope_theta": 10_000.0, "norm_eps": 1e-6, "max_seq_len": 32768},
)
