"""Llama 3 (3, 3.1, 3.2 text models); registers itself as ``llama3``."""

from __future__ import annotations

from titanium.models.flops import count_params_on_meta, decoder_flops_per_token
from titanium.models.llama3.args import LLAMA3_FLAVORS, Llama3Args
from titanium.models.llama3.hf import LLAMA3_HF_ADAPTER
from titanium.models.llama3.model import Transformer
from titanium.models.llama3.parallelize import apply_tensor_parallel
from titanium.models.registry import register_model
from titanium.models.spec import ModelSpec


def llama3_flops_per_token(args: Llama3Args, seq_len: int) -> float:
    """Training FLOPs per token for ``args`` at ``seq_len`` (see ``decoder_flops_per_token``)."""
    num_params = count_params_on_meta(Transformer, args, exclude_embedding=True)
    return decoder_flops_per_token(num_params, args.n_layers, args.n_heads, args.head_dim, seq_len)


LLAMA3_SPEC = register_model(
    ModelSpec(
        name="llama3",
        model_cls=Transformer,
        flavors=LLAMA3_FLAVORS,
        flops_per_token=llama3_flops_per_token,
        tp_plan=apply_tensor_parallel,
        hf_adapter=LLAMA3_HF_ADAPTER,
        chat_template="llama3",
    )
)

__all__ = [
    "LLAMA3_FLAVORS",
    "LLAMA3_SPEC",
    "Llama3Args",
    "Transformer",
    "llama3_flops_per_token",
]
