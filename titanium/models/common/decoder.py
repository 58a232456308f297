"""The decoder every family here shares: pre-norm blocks of GQA attention and SwiGLU, RoPE, RMSNorm.

A family (``models/llama3``, ``models/qwen3``) keeps its own argument dataclass, the one its published
checkpoints are described by, and converts it into ``DecoderArgs``: the one typed record this code reads.
Parameter names follow Meta's checkpoints (``tok_embeddings``, ``layers.N.attention.wq``, ...). Nothing here
knows about parallelism: parallel plans are applied from outside, which is why the module structure below
is part of the contract.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from titanium.models.common.attention import Attention, AttentionInputs, document_causal_mask
from titanium.models.common.attention_kernels import AttentionBackend, document_block_mask, masked_kernel
from titanium.models.common.feed_forward import FeedForward
from titanium.models.common.kv_cache import KVCache
from titanium.models.common.moe import MoE, MoEArgs
from titanium.models.common.norm import RMSNorm
from titanium.models.common.rope import RopeScaling, precompute_rope_tables


@dataclass(frozen=True)
class DecoderArgs:
    """Architecture of the shared decoder, with every choice explicit (no family defaults)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    """SwiGLU hidden width."""
    vocab_size: int
    norm_eps: float
    rope_theta: float
    max_seq_len: int
    """Length of the RoPE tables, i.e. the longest sequence (or largest position) accepted."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1 frequency scaling; None for plain RoPE."""
    qk_norm_eps: float | None = None
    """Per-head RMSNorm of queries and keys before RoPE (Qwen3); None for none (Llama)."""
    tie_word_embeddings: bool = False
    """Share the input embedding matrix with the output projection."""
    moe: MoEArgs | None = None
    """The Mixture-of-Experts feed-forward of the layers in ``moe_layers``; None for a dense model."""
    moe_layers: frozenset[int] = frozenset()
    """Layers whose feed-forward is ``moe`` instead of a SwiGLU of width ``ffn_dim``."""

    def __post_init__(self) -> None:
        if self.moe_layers and self.moe is None:
            raise ValueError("moe_layers are set but moe is None")


class FamilyArgs(Protocol):
    """What a family's argument dataclass offers the shared code: its conversion to ``DecoderArgs``."""

    n_layers: int
    vocab_size: int
    max_seq_len: int
    tie_word_embeddings: bool

    def decoder_args(self) -> DecoderArgs: ...


def unit_generator(seed: int, name: str, device: torch.device | str) -> torch.Generator:
    """A generator for the weights of the module called ``name``, seeded by the run seed and the name.

    Each module draws from its own stream, so its initial values depend only on the seed and its name:
    never on which other modules exist in this process (pipeline stages) or how many were drawn before.
    """
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def _trunc_normal(weight: torch.Tensor, std: float, generator: torch.Generator) -> None:
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)


class DecoderBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``, where ``ffn`` is a SwiGLU
    (``feed_forward``) or, in the ``moe_layers`` of an MoE model, a Mixture of Experts (``moe``)."""

    def __init__(self, layer_id: int, args: DecoderArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, args.qk_norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        sparse = args.moe is not None and layer_id in args.moe_layers
        self.feed_forward = None if sparse else FeedForward(args.dim, args.ffn_dim)
        self.moe = MoE(args.dim, args.moe) if sparse and args.moe is not None else None
        # Depth-scaled init for the matrices writing into the residual stream.
        self.out_init_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def forward(self, x: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), inputs)
        ffn = self.moe if self.moe is not None else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def init_weights(self, generator: torch.Generator) -> None:
        self.attention_norm.reset_parameters()
        self.attention.init_weights(self.out_init_std, generator=generator)
        self.ffn_norm.reset_parameters()
        ffn = self.moe if self.moe is not None else self.feed_forward
        ffn.init_weights(self.out_init_std, generator=generator)


class Decoder(nn.Module):
    """Decoder language model: ``tokens [B, S] -> logits [B, S, vocab_size]`` (float32).

    A pipeline splitter may set ``tok_embeddings``, ``norm`` and ``output`` to None and delete entries of
    ``layers`` (a ModuleDict keyed by the original layer index, so the surviving parameters keep their
    names). Without ``tok_embeddings`` the input is hidden states ``[B, S, dim]``; without ``output`` (or with
    ``project=False``) the result is the final hidden states.
    """

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        # Owned here and passed down (not per layer) so there is one copy; non-persistent
        # because it is derived from args and must not appear in checkpoints.
        rope_cos, rope_sin = self._rope_tables(device=None)
        self.register_buffer("rope_cos", rope_cos, persistent=False)
        self.register_buffer("rope_sin", rope_sin, persistent=False)
        self.layers = nn.ModuleDict({str(layer_id): DecoderBlock(layer_id, args) for layer_id in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self._tie_weights()
        self.attention_backend: AttentionBackend = "auto"
        """Kernel for masked attention ([model] attention; set by the model builder)."""

    def _tie_weights(self) -> None:
        if (
            self.args.tie_word_embeddings
            and self.tok_embeddings is not None
            and self.output is not None
            and self.output.weight is not self.tok_embeddings.weight
        ):
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn: Any, recurse: bool = True) -> Decoder:
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
        a = self.args
        return precompute_rope_tables(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling, device=device)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        project: bool = True,
    ) -> torch.Tensor:
        """``positions`` (``[S]`` or ``[B, S]``) overrides the default ``0..S-1`` for RoPE.

        ``document_ids`` ``[B, S]`` mark packed samples: attention stays within a sample (``positions``
        must then restart at 0 per sample). ``kv_cache`` appends this call's keys/values (decoding).
        ``project=False`` returns the final (normed) hidden states instead of logits, for losses that
        apply the output projection themselves (chunk by chunk).
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        inputs = AttentionInputs(self.rope_cos, self.rope_sin, positions, document_ids)
        if kv_cache is None:
            inputs = self.prepare_attention(inputs)
        for key, layer in self.layers.items():
            layer_inputs = inputs if kv_cache is None else dataclasses.replace(inputs, kv_cache=kv_cache.layers[key])
            h = layer(h, layer_inputs)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None or not project:
            return h
        return self.output(h).float()

    def prepare_attention(self, inputs: AttentionInputs) -> AttentionInputs:
        """The masks every layer shares, built once per forward: none for plain causal rows; for packed
        documents a FlexAttention block mask or a dense SDPA mask (``attention_backend``).

        A seam for parallel plans: context parallelism overrides it to gather positions and document ids once.
        """
        positions, document_ids = inputs.positions, inputs.document_ids
        if document_ids is None:
            return inputs
        if positions is None:
            raise ValueError("document_ids need positions (restarting at 0 in every document)")
        positions = positions.expand_as(document_ids)
        if masked_kernel(self.attention_backend, document_ids.device) == "flex":
            block_mask = document_block_mask(positions, positions, document_ids, document_ids)
            return dataclasses.replace(inputs, block_mask=block_mask)
        mask = document_causal_mask(positions, positions, document_ids, document_ids)
        return dataclasses.replace(inputs, mask=mask)

    def init_buffers(self, device: torch.device | str) -> None:
        """Recompute the RoPE tables on ``device`` (they are derived, never loaded)."""
        self.rope_cos, self.rope_sin = self._rope_tables(device=device)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None, seed: int = 0) -> None:
        """Initialise every parameter present and recompute the RoPE buffers.

        Meant to run after ``to_empty`` (meta-device construction), where parameters and buffers hold
        garbage. Each module draws from ``unit_generator(seed, its name)``, so a pipeline stage holding a
        few blocks initialises them exactly as a whole model would.

        The untied input embedding uses std 1.0 (every block reads the residual stream through RMSNorm,
        so its absolute scale is free; 1.0 lets token identity dominate the stream at first). A tied
        matrix also produces the logits, where std 1.0 would give logits of size ``sqrt(dim)``, so it
        gets the output projection's init, std ``dim ** -0.5``, instead.
        """
        self.init_buffers(buffer_device if buffer_device is not None else self.rope_cos.device)
        tied = self.args.tie_word_embeddings
        if self.tok_embeddings is not None and not tied:
            weight = self.tok_embeddings.weight
            nn.init.normal_(weight, mean=0.0, std=1.0, generator=unit_generator(seed, "tok_embeddings", weight.device))
        for key, layer in self.layers.items():
            layer.init_weights(unit_generator(seed, f"layers.{key}", layer.ffn_norm.weight.device))
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            projection = self.output.weight
        elif tied and self.tok_embeddings is not None:
            projection = self.tok_embeddings.weight
        else:
            return
        _trunc_normal(projection, self.args.dim**-0.5, unit_generator(seed, "output", projection.device))
