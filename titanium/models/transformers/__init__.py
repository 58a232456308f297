"""The transformers modeling backend: any Hugging Face causal LM that ``transformers`` knows, built from its
``config.json`` and trained under titanium's parallelism, objectives and checkpoints; registers itself as
``transformers``.

- ``args.py``: the model's ``config.json`` and what titanium reads of it;
- ``model.py``: ``TransformersModel``, the ``transformers`` model behind the shared decoder's interface;
- ``vision.py``: ``ImageTextModel``, an image-text-to-text model (its vision tower beside the language model), and
  ``image_feeds.py``: how each such architecture reads a batch's images;
- ``attention.py``: titanium's attention registered with ``transformers`` (documents, windows, KV cache);
- ``support.py``: which models run titanium's attention, which their own, and why; ``checks.py``: what a
  job may not ask of them (the preflight checks);
- ``plans.py`` / ``parallelize.py``: the config's tensor-parallel and pipeline plans, and their translation;
- ``hf.py``: checkpoint names (Hugging Face's own, nearly unchanged).
"""

from __future__ import annotations

from titanium.models.flops import count_params, decoder_flops_per_token
from titanium.models.registry import register_model
from titanium.models.spec import ModelSpec
from titanium.models.transformers.args import TransformersArgs
from titanium.models.transformers.checks import backend_refusals
from titanium.models.transformers.hf import TRANSFORMERS_HF_ADAPTER
from titanium.models.transformers.model import TransformersModel
from titanium.models.transformers.parallelize import apply_tensor_parallel
from titanium.models.transformers.vision import build_transformers_model

BACKEND = "transformers"


def transformers_flops_per_token(args: TransformersArgs, seq_len: int) -> float:
    """Training FLOPs per token (``decoder_flops_per_token``), from the parameters of the model built on meta that a
    token computes with."""
    import torch

    with torch.device("meta"):
        model = build_transformers_model(args)
    d = args.decoder_args()
    params = count_params(model, exclude_embedding=True, active_only=True)  # (titanium's MoE blocks: top_k of E)
    return decoder_flops_per_token(params, d.n_layers, d.n_heads, d.head_dim, seq_len)


TRANSFORMERS_SPEC = register_model(
    ModelSpec(
        name=BACKEND,
        model_cls=build_transformers_model,
        flavors={},
        flops_per_token=transformers_flops_per_token,
        tp_plan=apply_tensor_parallel,
        hf_adapter=TRANSFORMERS_HF_ADAPTER,
        refusals=backend_refusals,
    )
)

__all__ = ["BACKEND", "TRANSFORMERS_SPEC", "TransformersArgs", "TransformersModel", "build_transformers_model"]
