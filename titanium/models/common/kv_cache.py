"""Key/value cache for incremental decoding: each layer appends its new keys and values.

Plain tensors, no parallelism: generation runs the model one step at a time and every step's
attention sees everything cached so far. Each cached key keeps its RoPE position and document id,
so the attention mask of a cached step is the same document-causal rule as in training
(``document_causal_mask``): left-padded prompts are simply a padding "document" of their own.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

PAD_DOCUMENT = -1
"""The document of left padding (generation's prompts, rollout rows): a document no real token sees. Negative, so it
is never one of a packed row's samples (counted from 0): a model with layers that are not attention (the transformers
backend's linear-attention layers) masks the padding out by it (``titanium.models.transformers.model``)."""


class LayerKVCache:
    """One layer's cache of up to ``max_len`` tokens, filled from the left.

    The buffers are allocated at the first update, with the shape, dtype and device of the keys the
    layer produces (local heads, compute dtype), so the caller needs to know nothing about them.
    """

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.filled = 0

    def update(
        self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, document_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append ``[B, S, H_kv, D]`` keys/values; return everything cached (keys, values, positions, ids)."""
        start, end = self.filled, self.filled + k.shape[1]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; {end} requested")
        if start == 0:
            shape = (k.shape[0], self.max_len)
            self.k = k.new_zeros(shape + k.shape[2:])
            self.v = v.new_zeros(shape + v.shape[2:])
            self.positions = positions.new_zeros(shape)
            self.document_ids = document_ids.new_zeros(shape)
        self.k[:, start:end] = k
        self.v[:, start:end] = v
        self.positions[:, start:end] = positions
        self.document_ids[:, start:end] = document_ids
        self.filled = end
        return self.k[:, :end], self.v[:, :end], self.positions[:, :end], self.document_ids[:, :end]


class KVCache:
    """Caches for every layer of a decoder, keyed like its ``layers`` ModuleDict."""

    def __init__(self, layer_keys: Iterable[str], max_len: int) -> None:
        self.layers = {key: LayerKVCache(max_len) for key in layer_keys}
