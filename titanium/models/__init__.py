"""Model registry: the trainer looks model families up by name and never imports them.

A family registers a ``ModelSpec`` in ``titanium.models.registry`` when its package is imported; the built-in
families are imported here so that ``get_model_spec("llama3")`` just works.
"""

from __future__ import annotations

import titanium.models.gemma2  # noqa: F401
import titanium.models.llama3  # noqa: F401
import titanium.models.mistral  # noqa: F401
import titanium.models.phi3  # noqa: F401
import titanium.models.qwen2  # noqa: F401
import titanium.models.qwen3  # noqa: F401
import titanium.models.qwen3_moe  # noqa: F401
import titanium.models.transformers  # noqa: F401
from titanium.models.registry import (
    build_model_args,
    default_chat_format,
    get_model_spec,
    hf_family,
    list_models,
    register_model,
)
from titanium.models.spec import ModelSpec

__all__ = [
    "ModelSpec",
    "build_model_args",
    "default_chat_format",
    "get_model_spec",
    "hf_family",
    "list_models",
    "register_model",
]
