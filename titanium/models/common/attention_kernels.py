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
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

AttentionBackend = Literal["auto", "sdpa", "flex"]

# Compiled once per process, as the FlexAttention docs recommend: the eager version materializes the scores.
_compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
_compiled_create_block_mask = torch.compile(create_block_mask, dynamic=False)


def masked_kernel(backend: AttentionBackend, device: torch.device) -> Literal["sdpa", "flex"]:
    """The kernel for attention that needs a mask: ``auto`` is flex on CUDA and dense-mask SDPA elsewhere."""
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return backend


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA over ``[B, S, H, D]`` queries and ``[B, S_k, H_kv, D]`` keys/values; causal without a mask.

    ``mask`` is a boolean ``[B, 1, S, S_k]`` (or broadcastable) tensor where True means "may attend".
    """
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    groups = q.shape[1] // k.shape[1]
    gqa = groups > 1 and _sdpa_reads_grouped_heads(q, mask)
    if groups > 1 and not gqa:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return out.transpose(1, 2)


def _sdpa_reads_grouped_heads(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether an SDPA kernel takes ``H_kv < H`` itself (``enable_gqa``) for these inputs: the CPU kernels
    do; on CUDA only flash does (half precision, no mask, head_dim <= 256), and anything else would fall back
    silently to the math kernel (``[S, S_k]`` scores in memory), so K/V heads are repeated for those instead.
    """
    if q.device.type == "cpu":
        return True
    return mask is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """FlexAttention over ``[B, S, H, D]`` queries and ``[B, S_k, H_kv, D]`` keys/values under ``block_mask``.

    Compiled on accelerators; eager elsewhere (CPU runs only the forward, used by tests).
    """
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    kernel = flex_attention if q.device.type == "cpu" else _compiled_flex_attention
    out = kernel(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
    assert isinstance(out, torch.Tensor)
    return out.transpose(1, 2)


def document_block_mask(
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    q_documents: torch.Tensor | None,
    k_documents: torch.Tensor | None,
) -> BlockMask:
    """The FlexAttention form of ``document_causal_mask``: a query sees a key of its own document (any key
    when there are no document ids) at an earlier or equal position. ``[B, S_q]`` and ``[B, S_k]`` inputs.

    Built once per forward and shared by all layers; on CUDA the construction is compiled, so the
    ``[S_q, S_k]`` mask is evaluated block by block and never stored.
    """

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        causal = k_positions[b, kv_idx] <= q_positions[b, q_idx]
        if q_documents is None or k_documents is None:
            return causal
        return causal & (k_documents[b, kv_idx] == q_documents[b, q_idx])

    bsz, q_len = q_positions.shape
    build = create_block_mask if q_positions.device.type == "cpu" else _compiled_create_block_mask
    return build(mask_mod, bsz, None, q_len, k_positions.shape[1], device=q_positions.device)
