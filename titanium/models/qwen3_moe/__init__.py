"""Qwen3-MoE models (30B-A3B, 235B-A22B); registers itself as ``qwen3_moe``."""

from __future__ import annotations

from titanium.models.flops import decoder_model_flops_per_token
from titanium.models.qwen3.parallelize import apply_tensor_parallel
from titanium.models.qwen3_moe.args import QWEN3_MOE_FLAVORS, Qwen3MoeArgs
from titanium.models.qwen3_moe.hf import QWEN3_MOE_HF_ADAPTER
from titanium.models.qwen3_moe.model import Qwen3MoeTransformer
from titanium.models.registry import register_model
from titanium.models.spec import ModelSpec

QWEN3_MOE_SPEC = register_model(
    ModelSpec(
        name="qwen3_moe",
        model_cls=Qwen3MoeTransformer,
        flavors=QWEN3_MOE_FLAVORS,
        flops_per_token=decoder_model_flops_per_token,
        tp_plan=apply_tensor_parallel,
        hf_adapter=QWEN3_MOE_HF_ADAPTER,
    )
)

__all__ = [
    "QWEN3_MOE_FLAVORS",
    "QWEN3_MOE_SPEC",
    "Qwen3MoeArgs",
    "Qwen3MoeTransformer",
]
