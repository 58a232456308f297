"""The decoder every family here shares: pre-norm blocks of GQA attention and a gated MLP, RoPE, RMSNorm.

Where the families differ, ``DecoderArgs`` says how, one explicit field per difference: q/k/v biases (Qwen2),
per-head q/k norms (Qwen3), the norm style, norms after attention and MLP, GeGLU, scaled embeddings, another
softmax scale, soft-capped attention and output logits (Gemma 2), sliding-window layers (Mistral, Phi-3,
Gemma 2). A family (``models/llama3``, ``models/qwen3``) may keep its own argument dataclass, the one its
published checkpoints are described by, and convert it into ``DecoderArgs``: the one typed record this code
reads; the others use ``DecoderArgs`` itself (``decoder_args()`` returns it).
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
from titanium.models.common.attention_kernels import AttentionBackend, Scores, document_block_mask, masked_kernel
from titanium.models.common.feed_forward import Activation, FeedForward
from titanium.models.common.kv_cache import KVCache
from titanium.models.common.moe import MoE, MoEArgs
from titanium.models.common.norm import RMSNorm
from titanium.models.common.rope import RopeScaling, precompute_rope_tables


@dataclass(frozen=True)
class DecoderArgs:
    """Architecture of the shared decoder, with every choice explicit (defaults: Llama's)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    """Hidden width of the gated MLP."""
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
    attention_bias: bool = False
    """Biases on the q/k/v projections (Qwen2); the output projection has none."""
    norm_unit_offset: bool = False
    """Every RMSNorm scales by ``1 + w`` in float32 (Gemma; see ``RMSNorm``)."""
    post_norms: bool = False
    """Blocks also normalise the attention and MLP outputs before adding them to the residual (Gemma 2)."""
    activation: Activation = "silu"
    """The MLP gate's activation: SwiGLU (silu) or GeGLU (gelu_tanh)."""
    scale_embeddings: bool = False
    """Multiply the embeddings by ``sqrt(dim)`` (rounded to the activation dtype, as Gemma does)."""
    query_pre_attn_scalar: float | None = None
    """The attention logits are ``q . k / sqrt(query_pre_attn_scalar)`` (Gemma 2); None: ``sqrt(head_dim)``."""
    attn_logit_softcap: float | None = None
    """Attention logits become ``cap * tanh(logit / cap)`` (Gemma 2); None: no capping."""
    final_logit_softcap: float | None = None
    """Output logits become ``cap * tanh(logit / cap)`` (Gemma 2); None: no capping."""
    sliding_window: int | None = None
    """Sliding-window layers see only the last ``sliding_window`` positions (the query's own included)."""
    global_layers: tuple[int, ...] = ()
    """With ``sliding_window``: the layers that still attend globally (Gemma 2: every second one)."""
    moe: MoEArgs | None = None
    """The Mixture-of-Experts feed-forward of the layers in ``moe_layers``; None for a dense model."""
    moe_layers: frozenset[int] = frozenset()
    """Layers whose feed-forward is ``moe`` instead of a gated MLP of width ``ffn_dim``."""

    def __post_init__(self) -> None:
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        for name in ("dim", "n_layers", "n_heads", "head_dim", "ffn_dim", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap", "sliding_window"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive (or None), got {value}")
        if self.moe_layers and self.moe is None:
            raise ValueError("moe_layers are set but moe is None")

    def decoder_args(self) -> DecoderArgs:
        """Itself: families without an argument dataclass of their own use ``DecoderArgs`` directly."""
        return self

    def window(self, layer_id: int) -> int | None:
        """The sliding window layer ``layer_id`` applies, or None for global attention.

        A window of at least ``max_seq_len`` hides nothing (no two positions are that far apart), so it is None
        too: the layer then takes the plain causal path, which also leaves context parallelism open to it.
        """
        window = self.sliding_window
        if window is None or window >= self.max_seq_len or layer_id in self.global_layers:
            return None
        return window

    def scores(self) -> Scores:
        """The attention logit rule of every layer."""
        scale = None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar**-0.5
        return Scores(scale=scale, softcap=self.attn_logit_softcap)


class FamilyArgs(Protocol):
    """What a family's argument dataclass offers the shared code: its conversion to ``DecoderArgs``."""

    n_layers: int
    vocab_size: int
    max_seq_len: int
    tie_word_embeddings: bool

    def decoder_args(self) -> DecoderArgs: ...


_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def unit_generator(seed: int, name: str, device: torch.device | str) -> torch.Generator:
    """A generator for the weights of the module called ``name``, seeded by the run seed and the name.

    Each module draws from its own stream, so its initial values depend only on the seed and its name:
    never on which other modules exist in this process (pipeline stages) or how many were drawn before.
    """
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def _trunc_normal(weight: torch.Tensor, std: float, generator: torch.Generator) -> None:
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)


class DecoderBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``, where ``ffn`` is a gated MLP
    (``feed_forward``) or, in the ``moe_layers`` of an MoE model, a Mixture of Experts (``moe``); with
    ``post_norms`` (Gemma 2) the attention and MLP outputs are normalised too before they join the residual
    stream."""

    def __init__(self, layer_id: int, args: DecoderArgs) -> None:
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(args.dim, eps=args.norm_eps, unit_offset=args.norm_unit_offset)

        self.attention_norm = norm()
        self.attention = Attention(
            args.dim,
            args.n_heads,
            args.n_kv_heads,
            args.head_dim,
            args.qk_norm_eps,
            bias=args.attention_bias,
            scores=args.scores(),
            window=args.window(layer_id),
        )
        self.post_attention_norm = norm() if args.post_norms else None
        self.ffn_norm = norm()
        sparse = args.moe is not None and layer_id in args.moe_layers
        self.feed_forward = None if sparse else FeedForward(args.dim, args.ffn_dim, args.activation)
        self.moe = MoE(args.dim, args.moe) if sparse and args.moe is not None else None
        self.post_ffn_norm = norm() if args.post_norms else None
        # Depth-scaled init for the matrices writing into the residual stream.
        self.out_init_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def forward(self, x: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        out = self.attention(self.attention_norm(x), inputs)
        if self.post_attention_norm is not None:
            out = self.post_attention_norm(out)
        h = x + out
        ffn = self.moe if self.moe is not None else self.feed_forward
        out = ffn(self.ffn_norm(h))
        if self.post_ffn_norm is not None:
            out = self.post_ffn_norm(out)
        return h + out

    def init_weights(self, generator: torch.Generator) -> None:
        for norm in (self.attention_norm, self.post_attention_norm, self.ffn_norm, self.post_ffn_norm):
            if norm is not None:
                norm.reset_parameters()
        self.attention.init_weights(self.out_init_std, generator=generator)
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
        # Gemma multiplies the embeddings by sqrt(dim) as a tensor of the activations' dtype: the value rounded so,
        # per dtype (plain floats: no tensor, host sync or graph break in the forward).
        self.embedding_scale = (
            {dt: torch.tensor(args.dim**0.5, dtype=dt, device="cpu").item() for dt in _FLOAT_DTYPES}
            if args.scale_embeddings
            else None
        )
        self.layers = nn.ModuleDict({str(layer_id): DecoderBlock(layer_id, args) for layer_id in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, eps=args.norm_eps, unit_offset=args.norm_unit_offset)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Losses that apply the projection themselves (chunked cross-entropy) read the cap from it.
        self.output.logit_softcap = args.final_logit_softcap
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
        parent_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``positions`` (``[S]`` or ``[B, S]``) overrides the default ``0..S-1`` for RoPE.

        ``document_ids`` ``[B, S]`` mark packed samples: attention stays within a sample (``positions``
        must then restart at 0 per sample). ``parent_ids`` ``[B, S]`` (with ``document_ids``) name the document
        each token's document continues, whose earlier positions it also sees (a shared prompt; the token's own
        document where there is none; ``document_causal_mask``). ``kv_cache`` appends this call's keys/values
        (decoding). ``project=False`` returns the final (normed) hidden states instead of logits, for losses that
        apply the output projection themselves (chunk by chunk).
        """
        h = tokens
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            if self.embedding_scale is not None:
                h = h * self.embedding_scale[h.dtype]
        if positions is None and kv_cache is None and self._masked_windows(h.device, document_ids is not None):
            positions = torch.arange(h.shape[1], device=h.device)  # (the masks are built from positions)
        inputs = AttentionInputs(self.rope_cos, self.rope_sin, positions, document_ids, parent_ids)
        if kv_cache is None:
            inputs = self.prepare_attention(inputs)
        for key, layer in self.layers.items():
            layer_inputs = inputs if kv_cache is None else dataclasses.replace(inputs, kv_cache=kv_cache.layers[key])
            h = layer(h, layer_inputs)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None or not project:
            return h
        logits = self.output(h).float()
        cap = self.args.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _masked_windows(self, device: torch.device, documents: bool) -> list[int | None]:
        """The windows (None: global) of the present layers whose attention needs a mask: those with documents
        or a sliding window, and soft-capped ones on the flex kernel (its score_mod needs a block mask)."""
        windows = {layer.attention.window for layer in self.layers.values()}
        capped_flex = (
            self.args.attn_logit_softcap is not None and masked_kernel(self.attention_backend, device) == "flex"
        )
        return sorted((w for w in windows if w is not None or documents or capped_flex), key=lambda w: w or 0)

    def prepare_attention(self, inputs: AttentionInputs) -> AttentionInputs:
        """The masks every layer shares, built once per forward: none for plain causal rows; for packed
        documents, sliding windows or soft-capped flex attention a FlexAttention block mask or a dense SDPA mask
        (``attention_backend``), one for the global layers and one for the sliding-window layers.

        A seam for parallel plans: context parallelism overrides it to gather positions and document ids once.
        """
        positions, document_ids = inputs.positions, inputs.document_ids
        if document_ids is not None and positions is None:
            raise ValueError("document_ids need positions (restarting at 0 in every document)")
        if inputs.parent_ids is not None and document_ids is None:
            raise ValueError("parent_ids need document_ids")
        if positions is None:
            return inputs  # (forward supplies positions whenever a mask is needed)
        windows = self._masked_windows(positions.device, document_ids is not None)
        if not windows:
            return inputs
        positions = (
            positions.expand_as(document_ids) if document_ids is not None else positions.view(-1, positions.shape[-1])
        )
        flex = masked_kernel(self.attention_backend, positions.device) == "flex"
        masks = {}
        for window in windows:
            build = document_block_mask if flex else document_causal_mask
            masks[window] = build(positions, positions, document_ids, document_ids, window, inputs.parent_ids)
        global_mask, window_mask = masks.get(None), next((m for w, m in masks.items() if w is not None), None)
        if flex:
            return dataclasses.replace(inputs, block_mask=global_mask, window_block_mask=window_mask)
        return dataclasses.replace(inputs, mask=global_mask, window_mask=window_mask)

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
