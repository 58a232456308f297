"""titanium's attention behind ``transformers``' ``AttentionInterface``, so Hugging Face model code attends with
titanium's kernels and masks: packed documents, shared-prompt parent documents, sliding windows, soft-capping and
titanium's KV cache, exactly as in the shared decoder.

A model built by the backend registers ``titanium`` as its attention implementation. Its masks are not built
by ``transformers`` (``titanium`` has no entry in ``AttentionMaskInterface``, so the model passes none): the
backend's forward makes one ``AttentionContext`` per call, from titanium's positions, document ids and parent ids,
with one mask per sliding window the layers use (none at all for plain causal rows), and hands it to every layer
as a keyword argument that ``transformers`` passes through untouched. Each attention call then picks the mask of
its layer's window, or, decoding, appends its keys and values to its layer's cache in titanium's ``KVCache``
(keyed by the attention module's ``layer_idx``) and masks by the cached positions and documents, as the shared
decoder's ``Attention`` does. Under context parallelism the context carries the parallel plan's state instead
(``split``: the masks of this rank's queries over the whole sequence), which gathers the keys and values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask

from titanium.models.common.attention import document_causal_mask
from titanium.models.common.attention_kernels import (
    AttentionBackend,
    Scores,
    document_block_mask,
    flex,
    masked_kernel,
    sdpa,
)
from titanium.models.common.kv_cache import KVCache

ATTENTION = "titanium"
"""The name titanium's attention is registered under with ``transformers``."""
CONTEXT_KWARG = "titanium_attention"
"""The keyword argument that carries the ``AttentionContext`` through the model's forward to every attention call."""

Mask = torch.Tensor | BlockMask | None


@dataclasses.dataclass
class AttentionContext:
    """What every attention call of one forward shares: positions ``[B, S]`` (or ``[1, S]``), documents, parents,
    the KV cache when decoding, and the masks, one per sliding window (None: global layers), built once."""

    positions: torch.Tensor
    document_ids: torch.Tensor | None = None
    parent_ids: torch.Tensor | None = None
    kv_cache: KVCache | None = None
    masks: dict[int | None, Mask] = dataclasses.field(default_factory=dict)
    blocks: torch.Tensor | None = None
    """``[B, S]`` spans whose tokens see each other both ways (an image's tokens in Gemma 3), -1 elsewhere."""
    split: Any = None
    """Under context parallelism (``titanium.parallel.context.SplitSequence``): this rank's queries attend to the
    gathered keys by its masks, one per window, with ``split.attend(q, k, v, window, scores)``."""

    @classmethod
    def build(
        cls,
        positions: torch.Tensor,
        document_ids: torch.Tensor | None,
        parent_ids: torch.Tensor | None,
        kv_cache: KVCache | None,
        windows: tuple[int, ...],
        backend: AttentionBackend,
        blocks: torch.Tensor | None = None,
        splitter: Callable[..., Any] | None = None,
    ) -> AttentionContext:
        """The context of a forward whose layers use ``windows`` (sliding windows besides global attention). Rows
        without documents (or ``blocks``) need no mask for global layers (causal SDPA), nor for a window that covers
        the row. ``splitter``: the model's context-parallel plan (``TransformersModel.context_split``), which makes
        the forward's ``split``."""
        if document_ids is not None and positions.shape[0] != document_ids.shape[0]:
            positions = positions.expand_as(document_ids)
        if parent_ids is not None and document_ids is None:
            raise ValueError("parent_ids need document_ids")
        context = cls(positions, document_ids, parent_ids, kv_cache, blocks=blocks)
        if kv_cache is not None:
            if document_ids is None or parent_ids is not None:
                raise ValueError("decoding with a KV cache needs positions and document_ids (and no parent_ids)")
            return context
        if splitter is not None:
            if blocks is not None:
                raise ValueError("context parallelism does not split image blocks (the preflight checks refuse it)")
            context.split = splitter(positions, document_ids, parent_ids, windows, backend)
            return context
        seq = positions.shape[-1]
        flex_kernel = masked_kernel(backend, positions.device) == "flex"
        build = document_block_mask if flex_kernel else document_causal_mask
        for window in (None, *windows):
            if document_ids is None and blocks is None and (window is None or window >= seq):
                context.masks[window] = None
            else:
                context.masks[window] = build(
                    positions, positions, document_ids, document_ids, window, parent_ids, blocks, blocks
                )
        return context

    def mask(self, window: int | None) -> Mask:
        if window not in self.masks:
            raise RuntimeError(f"no mask was prepared for sliding window {window} (prepared: {sorted(self.masks)})")
        return self.masks[window]


def titanium_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function: queries ``[B, H, S, D]`` and keys/values ``[B, H_kv, S, D]`` (after
    RoPE, not repeated for GQA) -> ``([B, S, H, D], None)``. ``attention_mask`` is None (masks come from the
    context); sinks and dropout are features the backend's checks send to the model's own attention instead.
    A mask the model made itself (``transformers`` makes none for titanium's attention) is a cross-attention's
    (Llama 3.2 Vision's text over image tiles): that call is ``transformers``' SDPA with it, as the model's own."""
    if attention_mask is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    context = kwargs.get(CONTEXT_KWARG)
    if context is None:
        raise RuntimeError(
            f"titanium attention was called without its AttentionContext: {type(module).__name__}'s layer does not "
            "pass it on (support.code_reasons should have sent the model to its own attention)"
        )
    if attention_mask is not None:
        raise RuntimeError(
            f"{type(module).__name__} attends with a mask of its own, which titanium's attention would ignore "
            "(support.code_reasons should have sent the model to its own attention)"
        )
    if kwargs.get("s_aux") is not None or dropout:
        raise RuntimeError(f"{type(module).__name__} uses attention sinks or dropout, which titanium attention lacks")
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    scores = Scores(scale=scaling, softcap=softcap)
    if context.kv_cache is not None:
        cache = context.kv_cache.layers[str(module.layer_idx)]
        k, v, k_positions, k_documents = cache.update(k, v, context.positions, context.document_ids)
        blocks = context.blocks if context.blocks is not None and k.shape[1] == q.shape[1] else None  # (prefill)
        mask = document_causal_mask(
            context.positions, k_positions, context.document_ids, k_documents, sliding_window, None, blocks, blocks
        )
        return sdpa(q, k, v, mask, scores), None
    if context.split is not None:
        return context.split.attend(q, k, v, sliding_window, scores), None
    mask = context.mask(sliding_window)
    if isinstance(mask, BlockMask):
        return flex(q, k, v, mask, scores), None
    return sdpa(q, k, v, mask, scores), None


def register_titanium_attention() -> None:
    """Make ``titanium`` an attention implementation ``transformers`` models can be built with (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, titanium_attention)


def own_attention_masks(
    config: Any,
    attention: str,
    positions: torch.Tensor,
    document_ids: torch.Tensor,
    parent_ids: torch.Tensor | None,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The masks of packed documents (and shared prompts) for a model that runs its own attention (``support.py``),
    in the form its forward takes as ``attention_mask`` instead of making its own: one ``[B, 1, S, S]`` mask, or,
    for a model with ``layer_types``, one per layer type (a sliding-window type's with the config's window), as
    ``transformers``' ``generate`` prepares them. Boolean for SDPA; additive (0 or the float32 minimum) for eager
    attention, which adds the mask to its scores."""
    positions = positions.expand_as(document_ids)
    window = getattr(config, "sliding_window", None)

    def mask(windowed: bool) -> torch.Tensor:
        visible = document_causal_mask(
            positions, positions, document_ids, document_ids, window if windowed else None, parent_ids
        )
        if attention == "sdpa":
            return visible
        return torch.zeros(visible.shape, device=visible.device).masked_fill(~visible, torch.finfo(torch.float32).min)

    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return mask(windowed=bool(window) and getattr(config, "use_sliding_window", True) is not False)
    return {kind: mask(windowed=kind == "sliding_attention") for kind in set(layer_types)}
