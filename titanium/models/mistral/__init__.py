"""Mistral 7B (v0.1-v0.3) and NeMo 12B: the shared decoder, sliding window optional; registers itself as ``mistral``.

Llama 3's tensor-parallel plan applies unchanged (the same module names; the window is a mask, not a weight).
"""

from __future__ import annotations

from titanium.models.common.decoder import Decoder
from titanium.models.flops import decoder_model_flops_per_token
from titanium.models.llama3.parallelize import apply_tensor_parallel
from titanium.models.mistral.args import MISTRAL_FLAVORS
from titanium.models.mistral.hf import MISTRAL_HF_ADAPTER
from titanium.models.registry import register_model
from titanium.models.spec import ModelSpec

MISTRAL_SPEC = register_model(
    ModelSpec(
        name="mistral",
        model_cls=Decoder,
        flavors=MISTRAL_FLAVORS,
        flops_per_token=decoder_model_flops_per_token,
        tp_plan=apply_tensor_parallel,
        hf_adapter=MISTRAL_HF_ADAPTER,
    )
)

__all__ = ["MISTRAL_FLAVORS", "MISTRAL_SPEC"]
