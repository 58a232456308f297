"""Gemma 2 (2B, 9B, 27B): the shared decoder with Gemma 2's norms, GeGLU, soft-capping and alternating sliding
windows; registers itself as ``gemma2``."""

from __future__ import annotations

from titanium.models.common.decoder import Decoder
from titanium.models.flops import decoder_model_flops_per_token
from titanium.models.gemma2.args import GEMMA2_FLAVORS
from titanium.models.gemma2.hf import GEMMA2_HF_ADAPTER
from titanium.models.gemma2.parallelize import apply_tensor_parallel
from titanium.models.registry import register_model
from titanium.models.spec import ModelSpec

GEMMA2_SPEC = register_model(
    ModelSpec(
        name="gemma2",
        model_cls=Decoder,
        flavors=GEMMA2_FLAVORS,
        flops_per_token=decoder_model_flops_per_token,
        tp_plan=apply_tensor_parallel,
        hf_adapter=GEMMA2_HF_ADAPTER,
    )
)

__all__ = ["GEMMA2_FLAVORS", "GEMMA2_SPEC"]
