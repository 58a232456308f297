"""A KV cache of fixed shape, for a compiled decode step.

The growing cache (``titanium.models.common.kv_cache``) returns the filled part, so every step's
attention has a new shape and ``torch.compile`` would recompile. This cache always returns its whole
buffers and writes at a cursor kept on the device; slots not written yet carry the document id
``EMPTY_DOCUMENT``, which no query has (not even left padding's), so the document-causal mask hides them. Every
decode step then has the same shapes and one compiled graph serves them all (the price: attention over the full
buffer length at every step).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from titanium.models.common.kv_cache import KVCache, LayerKVCache

EMPTY_DOCUMENT = -2


class StaticLayerKVCache(LayerKVCache):
    """One layer's ``[B, max_len, ...]`` buffers, allocated at the first (prefill) update."""

    def __init__(self, max_len: int) -> None:
        super().__init__(max_len)
        self.cursor: torch.Tensor | None = None

    def update(
        self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, document_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.cursor is None:
            if k.shape[1] > self.max_len:
                raise ValueError(f"KV cache holds {self.max_len} tokens; {k.shape[1]} requested")
            shape = (k.shape[0], self.max_len)
            self.k = k.new_zeros(shape + k.shape[2:])
            self.v = v.new_zeros(shape + v.shape[2:])
            self.positions = positions.new_zeros(shape)
            self.document_ids = document_ids.new_full(shape, EMPTY_DOCUMENT)
            self.cursor = torch.zeros((), dtype=torch.long, device=k.device)
        # The caller sizes the cache (no bounds check here: it would need a device sync).
        index = self.cursor + torch.arange(k.shape[1], device=k.device)
        self.k.index_copy_(1, index, k)
        self.v.index_copy_(1, index, v)
        self.positions.index_copy_(1, index, positions.expand(k.shape[0], -1))
        self.document_ids.index_copy_(1, index, document_ids)
        self.cursor.add_(k.shape[1])
        return self.k, self.v, self.positions, self.document_ids


class StaticKVCache(KVCache):
    """Static caches for every layer of a decoder, keyed like its ``layers`` ModuleDict."""

    def __init__(self, layer_keys: Iterable[str], max_len: int) -> None:
        self.layers = {key: StaticLayerKVCache(max_len) for key in layer_keys}
