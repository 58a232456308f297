"""Phi-3 (mini, medium; 4k context) and Phi-4 (14B): the shared decoder; registers itself as ``phi3``.

The checkpoints fuse q/k/v and gate/up; titanium splits them on load (``hf.py``), so Llama 3's tensor-parallel
plan applies unchanged.
"""

from __future__ import annotations

from titanium.models.common.decoder import Decoder
from titanium.models.flops import decoder_model_flops_per_token
from titanium.models.llama3.parallelize import apply_tensor_parallel
from titanium.models.phi3.args import PHI3_FLAVORS
from titanium.models.phi3.hf import PHI3_HF_ADAPTER
from titanium.models.registry import register_model
from titanium.models.spec import ModelSpec

PHI3_SPEC = register_model(
    ModelSpec(
        name="phi3",
        model_cls=Decoder,
        flavors=PHI3_FLAVORS,
        flops_per_token=decoder_model_flops_per_token,
        tp_plan=apply_tensor_parallel,
        hf_adapter=PHI3_HF_ADAPTER,
    )
)

__all__ = ["PHI3_FLAVORS", "PHI3_SPEC"]
