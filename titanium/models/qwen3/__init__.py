"""Qwen3 dense models (0.6B-32B); registers itself as ``qwen3``."""

from __future__ import annotations

from titanium.models.flops import count_params_on_meta, decoder_flops_per_token
from titanium.models.qwen3.args import QWEN3_FLAVORS, Qwen3Args
from titanium.models.qwen3.hf import QWEN3_HF_ADAPTER
from titanium.models.qwen3.model import Qwen3Transformer
from titanium.models.qwen3.parallelize import apply_tensor_parallel
from titanium.models.registry import register_model
from titanium.models.spec import ModelSpec


def qwen3_flops_per_token(args: Qwen3Args, seq_len: int) -> float:
    """Training FLOPs per token for ``args`` at ``seq_len`` (see ``decoder_flops_per_token``)."""
    num_params = count_params_on_meta(Qwen3Transformer, args, exclude_embedding=True)
    return decoder_flops_per_token(num_params, args.n_layers, args.n_heads, args.head_dim, seq_len)


QWEN3_SPEC = register_model(
    ModelSpec(
        name="qwen3",
        model_cls=Qwen3Transformer,
        flavors=QWEN3_FLAVORS,
        flops_per_token=qwen3_flops_per_token,
        tp_plan=apply_tensor_parallel,
        hf_adapter=QWEN3_HF_ADAPTER,
        chat_template="qwen3",
    )
)

__all__ = [
    "QWEN3_FLAVORS",
    "QWEN3_SPEC",
    "Qwen3Args",
    "Qwen3Transformer",
    "qwen3_flops_per_token",
]
