"""Which module of a ``transformers`` model is its language model: the part the backend trains as
``TransformersModel``'s base, inside a causal LM or an image-text model (its own file: the config's MoE reading in
``args.py`` needs it without the image-text model's imports)."""

from __future__ import annotations

from torch import nn

from titanium.models.hf_adapter import HFConfigError

LANGUAGE_PARTS = ("embed_tokens", "layers", "norm")
"""What makes a module the language model (``TransformersModel``'s base)."""


def language_model(hf: nn.Module) -> nn.Module:
    """The module of ``hf`` that is its language model: embeddings, a ModuleList of layers and a final norm."""
    for module in hf.modules():
        if all(hasattr(module, part) for part in LANGUAGE_PARTS) and isinstance(module.layers, nn.ModuleList):
            return module
    raise HFConfigError(
        f"transformers' {type(hf).__name__} has no language model laid out as the backend needs (embed_tokens, a "
        f"ModuleList of layers and norm): model_type {hf.config.model_type!r} is not supported yet"
    )
