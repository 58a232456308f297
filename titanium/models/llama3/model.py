"""Llama 3 decoder.

Parameter names follow Meta's checkpoints (``tok_embeddings``, ``layers.N.attention.wq``,
...), so the layout is familiar and the HF adapter is a pure renaming plus the RoPE
permutation of ``wq``/``wk``. Nothing here knows about parallelism: parallel plans are
applied from outside, which is why the module structure below is part of the contract.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from titanium.models.common.attention import Attention
from titanium.models.common.feed_forward import FeedForward
from titanium.models.common.kv_cache import KVCache, LayerKVCache
from titanium.models.common.norm import RMSNorm
from titanium.models.common.rope import precompute_rope_tables
from titanium.models.llama3.args import Llama3Args


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(self, layer_id: int, args: Llama3Args) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args.dim, args.n_heads, args.kv_heads, args.head_dim, qk_norm_eps=args.qk_norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        # Depth-scaled init for the matrices writing into the residual stream.
        self.out_init_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def forward(
        self,
        x: torch.Tensor,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cos, rope_sin, positions, document_ids, kv_cache)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.attention.init_weights(self.out_init_std)
        self.ffn_norm.reset_parameters()
        self.feed_forward.init_weights(self.out_init_std)


class Transformer(nn.Module):
    """Llama 3 language model: ``tokens [B, S] -> logits [B, S, vocab_size]`` (float32).

    A pipeline splitter may set ``tok_embeddings``, ``norm`` and ``output`` to None and
    delete entries of ``layers`` (a ModuleDict keyed by the original layer index, so the
    surviving parameters keep their names). Without ``tok_embeddings`` the input is hidden
    states ``[B, S, dim]``; without ``output`` the result is hidden states.
    """

    def __init__(self, args: Any) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        # Owned here and passed down (not per layer) so there is one copy; non-persistent
        # because it is derived from args and must not appear in checkpoints.
        rope_cos, rope_sin = self._rope_tables(device=None)
        self.register_buffer("rope_cos", rope_cos, persistent=False)
        self.register_buffer("rope_sin", rope_sin, persistent=False)
        self.layers = nn.ModuleDict(
            {str(layer_id): TransformerBlock(layer_id, args) for layer_id in range(args.n_layers)}
        )
        self.norm: RMSNorm | None = RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self._tie_weights()

    def _tie_weights(self) -> None:
        if (
            self.args.tie_word_embeddings
            and self.tok_embeddings is not None
            and self.output is not None
            and self.output.weight is not self.tok_embeddings.weight
        ):
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn: Any, recurse: bool = True) -> Transformer:
        # nn.Module._apply (behind to_empty/to/cuda) can hand each user of a shared
        # parameter its own new Parameter, e.g. meta -> cpu in to_empty, which would
        # silently untie the embeddings. Re-tie afterwards.
        super()._apply(fn, recurse)
        self._tie_weights()
        # A whole-model cast such as .to(torch.bfloat16) would round the RoPE tables to a
        # few significant digits; rebuild them in float32 instead.
        if self.rope_cos.dtype != torch.float32:
            self.rope_cos, self.rope_sin = self._rope_tables(device=self.rope_cos.device)
        return self

    def _rope_tables(self, device: torch.device | str | None) -> tuple[torch.Tensor, torch.Tensor]:
        return precompute_rope_tables(
            self.args.head_dim,
            self.args.max_seq_len,
            self.args.rope_theta,
            self.args.rope_scaling,
            device=device,
        )

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """``positions`` (``[S]`` or ``[B, S]``) overrides the default ``0..S-1`` for RoPE.

        ``document_ids`` ``[B, S]`` mark packed samples: attention stays within a sample (``positions``
        must then restart at 0 per sample). ``kv_cache`` appends this call's keys/values (decoding).
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for key, layer in self.layers.items():
            layer_cache = kv_cache.layers[key] if kv_cache is not None else None
            h = layer(h, self.rope_cos, self.rope_sin, positions, document_ids, layer_cache)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        return self.output(h).float()

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialise every parameter and recompute the RoPE buffers.

        Meant to run after ``to_empty`` (meta-device construction), where parameters and
        buffers hold garbage; the draw order is fixed, so the result depends only on the
        global torch seed. ``buffer_device`` defaults to where the buffers already live.

        The untied input embedding uses std 1.0 (every block reads the residual stream
        through RMSNorm, so its absolute scale is free; 1.0 lets token identity dominate the
        stream at first, as in torchtitan). A tied matrix also produces the logits, where
        std 1.0 would give logits of size ``sqrt(dim)``, so it gets the output projection's
        init, std ``dim ** -0.5``, instead.
        """
        device = buffer_device if buffer_device is not None else self.rope_cos.device
        self.rope_cos, self.rope_sin = self._rope_tables(device=device)

        tied = self.args.tie_word_embeddings
        if self.tok_embeddings is not None and not tied:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        output_std = self.args.dim**-0.5
        if self.output is not None:
            projection = self.output.weight
        elif tied and self.tok_embeddings is not None:
            projection = self.tok_embeddings.weight
        else:
            return
        nn.init.trunc_normal_(projection, mean=0.0, std=output_std, a=-3 * output_std, b=3 * output_std)
