"""Decoding a backend model that runs its own attention (``support.py``) with ``transformers``' own cache.

titanium's sampler (``titanium.generation.generate``) hands every forward of a generation the same ``KVCache``,
with titanium's positions and document ids: left-padded prompts are a padding document before each row's prompt.
A model on titanium's attention appends to that cache's layers. A model that runs its own attention (GPT-OSS's
sinks, Qwen3.5's linear-attention layers) cannot: its layers cache through ``transformers``' ``Cache`` (key/value
layers, sliding-window layers, the convolution and recurrent states of linear attention). So the backend keeps a
``DynamicCache`` built from the model's config on titanium's ``KVCache`` object, with the document ids seen so far,
and each call passes the model the cache and a padding mask: the keys of each row's current document. That is
what ``transformers``' own generation passes for left-padded prompts, so the model masks the padding out in its
attention layers and zeroes it before its recurrent ones (which would otherwise carry it in their state).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import torch

from titanium.models.common.kv_cache import KVCache


@dataclasses.dataclass
class OwnCache:
    """What a model decoding with its own cache keeps between the calls of one generation."""

    cache: Any
    """The ``transformers`` cache of the model's layers."""
    documents: torch.Tensor
    """``[B, T]`` document ids of the tokens cached so far."""


def decoding_inputs(base: torch.nn.Module, config: Any, kv_cache: KVCache, document_ids: torch.Tensor) -> dict:
    """The keyword arguments of ``base``'s forward (the backend's base model) for one step of a generation that
    ``kv_cache`` belongs to: the model's own cache (made at the first step), caching on, and the attention mask of
    the keys in each row's current document (the row's last token's)."""
    state: OwnCache | None = getattr(kv_cache, "own_cache", None)
    if state is None:
        from transformers import DynamicCache

        state = OwnCache(DynamicCache(config=config), document_ids[:, :0])
        kv_cache.own_cache = state
    state.documents = torch.cat([state.documents, document_ids], dim=1)
    mask = (state.documents == document_ids[:, -1:]).long()
    return {_cache_keyword(type(base)): state.cache, "use_cache": True, "attention_mask": mask}


@functools.cache
def _cache_keyword(base: type) -> str:
    """``cache`` in ``transformers`` 5.2x's forwards; ``past_key_values`` in earlier ones (still accepted). Read once
    per class (not at every decoding step)."""
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
