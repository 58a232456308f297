"""The attention kernels behind ``Attention``: SDPA (causal or with a dense mask) and FlexAttention.

Which one runs is decided once per forward pass (``Decoder.prepare_attention``), never per layer:

- no document mask: SDPA with ``is_causal=True`` (flash kernels on GPU, no mask tensor anywhere);
- document (or context-parallel) masks, ``flex``: a FlexAttention ``BlockMask`` built once per forward and
  shared by every layer, so fully masked blocks cost nothing and no ``[S, S]`` tensor exists;
- the same masks, ``sdpa``: a dense boolean mask built once per forward. This is the exact CPU path
  (FlexAttention has no backward on CPU) and the reference the flex path is tested against.

Grouped-query attention passes the ``H_kv`` key/value heads straight to the kernel (FlexAttention and
SDPA's ``enable_gqa``), so the keys and values are not repeated to ``H`` heads in memory, except for the
SDPA inputs no fused CUDA kernel takes grouped (see ``_sdpa_reads_grouped_heads``).

A layer's ``Scores`` change the softmax's input: another scale than ``1 / sqrt(head_dim)`` goes to every kernel;
soft-capping (``cap * tanh(score / cap)``, Gemma 2) is a FlexAttention ``score_mod``, and on the dense path,
which SDPA cannot cap, an exact eager softmax (``[S, S_k]`` scores in memory: the CPU path and the reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

AttentionBackend = Literal["auto", "sdpa", "flex"]

# Compiled once per process, as the FlexAttention docs recommend: the eager version materializes the scores.
_compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
_compiled_create_block_mask = torch.compile(create_block_mask, dynamic=False)


@dataclass(frozen=True)
class Scores:
    """How a layer turns ``q . k`` into attention logits, beyond the default ``q . k / sqrt(head_dim)``."""

    scale: float | None = None
    """Multiplies ``q . k``; None: ``head_dim ** -0.5``."""
    softcap: float | None = None
    """Logit soft-capping: scaled scores become ``softcap * tanh(score / softcap)`` before the mask (Gemma 2)."""


PLAIN_SCORES = Scores()


def masked_kernel(backend: AttentionBackend, device: torch.device) -> Literal["sdpa", "flex"]:
    """The kernel for attention that needs a mask: ``auto`` is flex on CUDA and dense-mask SDPA elsewhere."""
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return backend


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scores: Scores = PLAIN_SCORES
) -> torch.Tensor:
    """Dense attention over ``[B, S, H, D]`` queries and ``[B, S_k, H_kv, D]`` keys/values; causal without a mask.

    ``mask`` is a boolean ``[B, 1, S, S_k]`` (or broadcastable) tensor where True means "may attend". SDPA
    computes it, unless ``scores`` soft-caps: then an exact eager softmax does (see ``_softcapped``).
    """
    if scores.softcap is not None:
        return _softcapped(q, k, v, mask, scores.scale, scores.softcap)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    groups = q.shape[1] // k.shape[1]
    gqa = groups > 1 and _sdpa_reads_grouped_heads(q, mask)
    if groups > 1 and not gqa:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scores.scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scores.scale)
    return out.transpose(1, 2)


def _softcapped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None, cap: float
) -> torch.Tensor:
    """Soft-capped attention written out, in the order of Gemma 2's reference code: scale, cap, mask, softmax in
    float32, cast back, weight the values. ``mask`` None: causal (queries are the last ``S`` of ``S_k`` keys)."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    logits = q @ k.transpose(2, 3) * (q.shape[-1] ** -0.5 if scale is None else scale)
    logits = torch.tanh(logits / cap) * cap
    if mask is None:
        q_len, k_len = logits.shape[-2:]
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
    logits = logits.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    return (weights @ v).transpose(1, 2)


def _sdpa_reads_grouped_heads(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether an SDPA kernel takes ``H_kv < H`` itself (``enable_gqa``) for these inputs: the CPU kernels
    do; on CUDA only flash does (half precision, no mask, head_dim <= 256), and anything else would fall back
    silently to the math kernel (``[S, S_k]`` scores in memory), so K/V heads are repeated for those instead.
    """
    if q.device.type == "cpu":
        return True
    return mask is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256


def flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, scores: Scores = PLAIN_SCORES
) -> torch.Tensor:
    """FlexAttention over ``[B, S, H, D]`` queries and ``[B, S_k, H_kv, D]`` keys/values under ``block_mask``;
    soft-capping (``scores``) is a ``score_mod``, fused into the kernel.

    Compiled on accelerators; eager elsewhere (CPU runs only the forward, used by tests).
    """
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    kernel = flex_attention if q.device.type == "cpu" else _compiled_flex_attention
    score_mod = None if scores.softcap is None else _softcap_mod(scores.softcap)
    out = kernel(
        q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scores.scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    assert isinstance(out, torch.Tensor)
    return out.transpose(1, 2)


def _softcap_mod(cap: float):
    def softcap(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor):
        return torch.tanh(score / cap) * cap

    return softcap


def document_block_mask(
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    q_documents: torch.Tensor | None,
    k_documents: torch.Tensor | None,
    window: int | None = None,
    q_parents: torch.Tensor | None = None,
    q_blocks: torch.Tensor | None = None,
    k_blocks: torch.Tensor | None = None,
) -> BlockMask:
    """The FlexAttention form of ``document_causal_mask``: a query sees a key of its own document (any key
    when there are no document ids) at an earlier or equal position, and with ``window`` fewer than ``window``
    positions back; with ``q_parents``, also a key of its parent document at an earlier position; with ``q_blocks``
    and ``k_blocks``, also the later keys of its own block (one image's tokens). ``[B, S_q]``
    and ``[B, S_k]`` inputs; positions of batch 1 (without documents) give a mask that broadcasts over the batch.

    Built once per forward and shared by all layers; on CUDA the construction is compiled, so the
    ``[S_q, S_k]`` mask is evaluated block by block and never stored.
    """
    row = 0 if q_positions.shape[0] == 1 and k_positions.shape[0] == 1 else None  # (the one row of a broadcast)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        at = b if row is None else row
        q_position, k_position = q_positions[at, q_idx], k_positions[at, kv_idx]
        visible = k_position <= q_position
        if q_blocks is not None and k_blocks is not None:
            q_block = q_blocks[b, q_idx]
            visible = visible | ((q_block == k_blocks[b, kv_idx]) & (q_block >= 0))
        if window is not None:
            visible = visible & (q_position - k_position < window)
        if q_documents is None or k_documents is None:
            return visible
        k_document = k_documents[b, kv_idx]
        same = k_document == q_documents[b, q_idx]
        if q_parents is not None:
            same = same | ((k_document == q_parents[b, q_idx]) & (k_position < q_position))
        return visible & same

    bsz, q_len = q_positions.shape
    build = create_block_mask if q_positions.device.type == "cpu" else _compiled_create_block_mask
    return build(mask_mod, bsz, None, q_len, k_positions.shape[1], device=q_positions.device)
