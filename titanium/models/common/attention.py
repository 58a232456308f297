"""Causal grouped-query attention (GQA) with RoPE."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from titanium.models.common.attention_kernels import PLAIN_SCORES, Scores, flex, sdpa
from titanium.models.common.kv_cache import LayerKVCache
from titanium.models.common.norm import RMSNorm
from titanium.models.common.rope import apply_rope


@dataclass(frozen=True)
class AttentionInputs:
    """Everything an attention layer needs besides its hidden states, made once per forward pass.

    One object instead of a long argument list, so the signature is written once (the blocks, the
    parallel plans and context parallelism all pass it through untouched).
    """

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    positions: torch.Tensor | None = None
    """Token positions ``[S]`` or ``[B, S]`` for RoPE (global ones under context parallelism)."""
    document_ids: torch.Tensor | None = None
    """Packed samples ``[B, S]``: attention stays within a document."""
    parent_ids: torch.Tensor | None = None
    """``[B, S]`` with ``document_ids``: the document whose earlier positions a token's document continues (a
    prompt shared by two responses, see ``document_causal_mask``); a token's own document where there is none."""
    mask: torch.Tensor | None = None
    """The dense document-causal mask of ``positions``/``document_ids`` (the SDPA path), if any."""
    block_mask: BlockMask | None = None
    """The same mask as a FlexAttention block mask (the flex path), if any."""
    window_mask: torch.Tensor | None = None
    """``mask`` restricted to the sliding window, for the layers that have one."""
    window_block_mask: BlockMask | None = None
    """``block_mask`` restricted to the sliding window, for the layers that have one."""
    plan_state: object | None = None
    """What a parallel plan prepared once per forward for its ``attend`` (context parallelism: the
    gathered key positions and per-chunk masks)."""
    kv_cache: LayerKVCache | None = None
    """This layer's cache when decoding."""


def document_causal_mask(
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    q_documents: torch.Tensor | None,
    k_documents: torch.Tensor | None,
    window: int | None = None,
    q_parents: torch.Tensor | None = None,
    q_blocks: torch.Tensor | None = None,
    k_blocks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean SDPA mask ``[B, 1, S_q, S_k]``: a query sees a key of its own document (any key without document
    ids) at an earlier or equal position, and with a sliding ``window`` fewer than ``window`` positions back.
    With ``q_parents`` (the query's parent document) it also sees the keys of its parent document at earlier
    positions than its own: two responses placed after one prompt (prompt, chosen, rejected in one row, their
    positions each continuing the prompt's) each see the prompt and themselves, never each other.
    With ``q_blocks`` / ``k_blocks`` (``[B, S]``, -1 outside any block) a query also sees the later keys of its own
    block: the tokens of one image attend to each other both ways (Gemma 3), still inside the window.

    Positions restart at 0 in every packed document, so within a document they order the tokens as
    their indices do; comparing positions (not indices) keeps the rule right when the queries are a
    context-parallel shard or a decoding step and the keys are the whole sequence or a KV cache.
    """
    distance = q_positions[:, :, None] - k_positions[:, None, :]
    visible = distance >= 0
    if q_blocks is not None and k_blocks is not None:
        visible = visible | ((q_blocks[:, :, None] == k_blocks[:, None, :]) & (q_blocks[:, :, None] >= 0))
    if window is not None:
        visible = visible & (distance < window)
    if q_documents is not None and k_documents is not None:
        same = k_documents[:, None, :] == q_documents[:, :, None]
        if q_parents is not None:
            same = same | ((k_documents[:, None, :] == q_parents[:, :, None]) & (distance > 0))
        visible = visible & same
    return visible.unsqueeze(1)


class Attention(nn.Module):
    """Multi-head causal self-attention where ``n_kv_heads`` may divide ``n_heads``.

    Head counts are never baked into reshapes (``view(B, S, -1, head_dim)``), so tensor
    parallelism can shard ``wq``/``wk``/``wv`` by output rows and ``wo`` by input columns
    and this module runs unchanged on the local heads.

    ``head_dim`` is independent of ``dim // n_heads`` (Qwen3 uses 128 at every size). With
    ``qk_norm_eps`` set, each query and key head is RMS-normalised (one learned scale of
    ``head_dim`` shared by all heads) before RoPE, as in Qwen3; the norms are per head, so
    they work unchanged on the local heads of a tensor-parallel shard. ``bias`` gives ``wq``/``wk``/``wv``
    biases (Qwen2), ``scores`` another softmax scale or soft-capping (Gemma 2), and ``window`` a sliding
    window: a query sees only the last ``window`` positions (itself included).
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        qk_norm_eps: float | None = None,
        *,
        bias: bool = False,
        scores: Scores = PLAIN_SCORES,
        window: int | None = None,
    ) -> None:
        super().__init__()
        if n_heads % n_kv_heads != 0:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim, eps=qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, eps=qk_norm_eps) if qk_norm_eps is not None else None
        self.scores = scores
        self.window = window

    def forward(self, x: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """``x`` ``[B, S, dim]`` -> ``[B, S, dim]``.

        Without document ids masking is plain causal over the row; with them a token attends only within
        its document. With a KV cache (decoding) the new keys are appended and the queries attend to the cache.
        """
        bsz, seq_len, _ = x.shape
        q = self.wq(x).view(bsz, seq_len, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq_len, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq_len, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, k, inputs.rope_cos, inputs.rope_sin, inputs.positions)
        if inputs.kv_cache is not None:
            positions, document_ids = inputs.positions, inputs.document_ids
            if positions is None or document_ids is None or inputs.parent_ids is not None:
                raise ValueError("decoding with a KV cache needs positions and document_ids (and no parent_ids)")
            k, v, k_positions, k_documents = inputs.kv_cache.update(k, v, positions, document_ids)
            mask = document_causal_mask(positions, k_positions, document_ids, k_documents, self.window)
            out = sdpa(q, k, v, mask, self.scores)
        else:
            out = self.attend(q, k, v, inputs)
        return self.wo(out.reshape(bsz, seq_len, -1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """Attention of ``[B, S, H, D]`` queries to keys/values ``[B, S, H_kv, D]``; ``[B, S, H, D]``.

        The kernel follows the masks the decoder prepared (the window's, for a sliding-window layer): a block
        mask (flex), a dense mask or none (causal). A seam for parallel plans: context parallelism replaces it
        (on the instance's class) to attend to the keys and values of the whole sequence, gathered from the
        other ranks.
        """
        windowed = self.window is not None
        block_mask = inputs.window_block_mask if windowed else inputs.block_mask
        if block_mask is not None:
            return flex(q, k, v, block_mask, self.scores)
        return sdpa(q, k, v, inputs.window_mask if windowed else inputs.mask, self.scores)

    def init_weights(
        self, out_init_std: float, in_init_std: float = 0.02, generator: torch.Generator | None = None
    ) -> None:
        """``wq``/``wk``/``wv`` get ``in_init_std``; ``wo``, which writes into the residual
        stream, gets the depth-scaled ``out_init_std``. Truncation is at 3 standard deviations; biases start at 0.
        """
        for linear, std in (
            (self.wq, in_init_std),
            (self.wk, in_init_std),
            (self.wv, in_init_std),
            (self.wo, out_init_std),
        ):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()

    def extra_repr(self) -> str:
        parts = [] if self.scores == PLAIN_SCORES else [f"scores={self.scores}"]
        return ", ".join(parts + ([] if self.window is None else [f"window={self.window}"]))
