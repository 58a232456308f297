"""Qwen2 and Qwen2.5 (0.5B-72B): the shared decoder with q/k/v biases; registers itself as ``qwen2``.

Llama 3's tensor-parallel plan applies unchanged: ``ColwiseParallel`` shards each bias with its projection's rows.
"""

from __future__ import annotations

from titanium.models.common.decoder import Decoder
from titanium.models.flops import decoder_model_flops_per_token
from titanium.models.llama3.parallelize import apply_tensor_parallel
from titanium.models.qwen2.args import QWEN2_FLAVORS
from titanium.models.qwen2.hf import QWEN2_HF_ADAPTER
from titanium.models.registry import register_model
from titanium.models.spec import ModelSpec

QWEN2_SPEC = register_model(
    ModelSpec(
        name="qwen2",
        model_cls=Decoder,
        flavors=QWEN2_FLAVORS,
        flops_per_token=decoder_model_flops_per_token,
        tp_plan=apply_tensor_parallel,
        hf_adapter=QWEN2_HF_ADAPTER,
        chat_template="chatml",
    )
)

__all__ = ["QWEN2_FLAVORS", "QWEN2_SPEC"]
