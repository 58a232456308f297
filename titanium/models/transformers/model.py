"""A Hugging Face causal LM, built by ``transformers`` from its ``config.json``, behind the shared decoder's interface.

``TransformersModel`` owns the modules of an ``AutoModelForCausalLM`` under the names every part of titanium
already knows from ``Decoder``: ``tok_embeddings``, ``layers`` (a ModuleDict keyed by layer index), ``norm`` and
``output`` (the LM head), plus the base model's other children under their own names (its rotary embedding).
Pipeline splitting, FSDP units, activation checkpointing, regional compilation, the HF export's block walk and
the weight sync all work on those names unchanged, and inside a block every name is Hugging Face's, so LoRA
targets, TP plans and PEFT exports read the model's own ``q_proj``/``down_proj``.

The forward is ``transformers``' own: the base model's forward runs over whatever the wrapper holds at the time
(``_install`` hands it the current embedding, layers and norm, so a pipeline stage runs its own layers and an
activation-checkpoint wrapper runs in a layer's place), with titanium's positions as ``position_ids`` and
titanium's attention (``attention.py``) carrying documents, parent documents and the KV cache. The LM head is
applied here, with the logit transforms the model's ``*ForCausalLM`` applies (Granite's ``logits_scaling``,
Cohere's ``logit_scale``, Gemma's final soft-cap), so losses that project by themselves can get the hidden states.

Initialization is layout-independent like the shared decoder's: each unit (the embedding, each layer, the norm,
the head) is initialized by the model's own ``_init_weights`` under a generator seeded by the run seed and the
unit's name. Non-persistent buffers (rotary frequencies, Gemma's embedding scale) are recomputed by the same
``_init_weights`` after ``to_empty``, never loaded.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from titanium.models.common.attention_kernels import AttentionBackend
from titanium.models.common.decoder import unit_generator
from titanium.models.common.kv_cache import PAD_DOCUMENT, KVCache
from titanium.models.common.moe import MoE
from titanium.models.hf_adapter import HFConfigError
from titanium.models.transformers.args import TransformersArgs
from titanium.models.transformers.attention import (
    ATTENTION,
    CONTEXT_KWARG,
    AttentionContext,
    own_attention_masks,
    register_titanium_attention,
)
from titanium.models.transformers.moe import own_moe_blocks, swap_moe_blocks
from titanium.models.transformers.own_cache import decoding_inputs
from titanium.models.transformers.support import fallback_reasons, non_attention_layers, own_attention

BASE_PARTS = {"tok_embeddings": "embed_tokens", "layers": "layers", "norm": "norm"}
"""Our name -> the base model's, for the parts the shared decoder's interface names."""
HEAD = "lm_head"


class _PassThrough(nn.Module):
    """Stands in for a layer another pipeline stage holds: the hidden states pass unchanged."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


def check_structure(model: nn.Module) -> None:
    """Refuse a ``transformers`` model without the parts the backend names (``BASE_PARTS``, ``HEAD``)."""
    base = model.base_model
    missing = [f"{type(base).__name__}.{name}" for name in BASE_PARTS.values() if not hasattr(base, name)]
    missing += [f"{type(model).__name__}.{HEAD}"] if not hasattr(model, HEAD) else []
    if not isinstance(getattr(base, "layers", None), nn.ModuleList):
        missing.append(f"{type(base).__name__}.layers (a ModuleList)")
    others = [name for name, _ in model.named_children() if name not in (model.base_model_prefix, HEAD)]
    if missing or others:
        raise HFConfigError(
            f"transformers' {type(model).__name__} is not laid out as the backend needs (a base model with "
            "embed_tokens, a ModuleList of layers and norm, and an lm_head beside it, nothing else; "
            + (f"missing: {', '.join(missing)}" if missing else f"it also has {', '.join(others)}")
            + f"): model_type {model.config.model_type!r} is not supported by the transformers backend yet"
        )


def build_hf_model(args: TransformersArgs) -> tuple[nn.Module, list[str]]:
    """``AutoModelForCausalLM.from_config`` of ``args`` in float32, on the current device, with titanium's attention
    where it can serve the model (else the model's own), and the reasons it cannot (``support.py``)."""
    from transformers import AutoModelForCausalLM

    register_titanium_attention()
    config = copy.deepcopy(args.hf_config)  # (from_config writes its dtype and attention into it)
    trust = args.code_folder is not None
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust)
    reasons = fallback_reasons(model, config)
    model.set_attn_implementation(own_attention(model) if reasons else ATTENTION)
    return model, reasons


class TransformersModel(nn.Module):
    """``tokens [B, S] -> logits [B, S, vocab]`` (float32) of a ``transformers`` causal LM, with the shared
    decoder's forward signature, module names and hooks (module docstring)."""

    BASE_NAMES = ("tok_embeddings", "layers", "norm", "output")
    """Our names of the language model's parts (``BASE_PARTS`` and the head)."""

    def __init__(self, args: TransformersArgs) -> None:
        super().__init__()
        self.args = args
        hf, self.fallback_reasons = self._build_hf(args)
        mark_initializers(hf)
        base, head = self._language_parts(hf)
        config = args.text_config
        self.moe_args, self.moe_layers = swap_moe_blocks(base, args.model_type)
        """titanium's MoE in the blocks of ``moe_layers`` (``moe.py``); None: no block titanium computes."""
        self.attention: str = hf.config.get_text_config()._attn_implementation
        """``titanium`` (``attention.py``), or the model's own where titanium's cannot serve it (``support.py``)."""
        self.mixes_documents = bool(non_attention_layers(hf, config))
        """Some layers are no attention: they would mix the samples of a packed row."""
        self.tok_embeddings: nn.Module | None = base.embed_tokens
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(base.layers)})
        self.norm: nn.Module | None = base.norm
        self.output: nn.Module | None = head
        self.own_moe_blocks = own_moe_blocks(self.layers, prefix="layers")
        """The MoE blocks that run as ``transformers`` wrote them (no expert parallelism, no load balancing)."""
        self._extra = [name for name in base._modules if name not in BASE_PARTS.values()]
        for name in self._extra:
            setattr(self, name, base._modules[name])
        base._modules.clear()  # (ours now: the base model runs them through _install)
        hf._modules.clear()
        object.__setattr__(self, "_hf", hf)  # plain attributes: not submodules, not in the state dict
        object.__setattr__(self, "_base", base)
        self.output.logit_softcap = getattr(config, "final_logit_softcapping", None)  # (read by chunked losses)
        self.logit_multiplier = float(getattr(hf, "logit_scale", 1.0)) / float(getattr(config, "logits_scaling", 1.0))
        self.logit_multiplier /= float(getattr(config, "logits_mup_width_multiplier", 1.0))  # (Inkling)
        self.windows = sliding_windows(self.layers, config)
        self.attention_backend: AttentionBackend = "auto"
        """Kernel for masked attention ([model] attention; set by the model builder)."""
        self.context_split: Any = None
        """Under context parallelism, set by ``titanium.parallel.context.apply_context_parallel``: makes each forward's
        masks over the sequence gathered from the ranks (``AttentionContext.build``'s ``splitter``)."""
        self._tie_weights()

    # ----- structure -----

    def use_score_head(self) -> None:
        """Become a reward or value model (``titanium/models/reward.py``): the LM head replaced by a scalar score
        head ``[1, hidden]``, the architecture's ``*ForSequenceClassification`` ``score`` layer, which
        ``transformers`` applies to the final hidden states as they are (no logit scaling or soft-capping) and never
        ties to the embedding."""
        from titanium.models.reward import ScoreHead

        self.args = dataclasses.replace(self.args, score_head=True)
        self.output = ScoreHead(int(self.args.text_config.hidden_size))
        self.logit_multiplier = 1.0

    def _build_hf(self, args: TransformersArgs) -> tuple[nn.Module, list[str]]:
        """The ``transformers`` model (on the current device) and why it runs its own attention, if it does."""
        return build_hf_model(args)

    def _language_parts(self, hf: nn.Module) -> tuple[nn.Module, nn.Module]:
        """The base model (embeddings, layers, norm) and the LM head of ``hf``, refused unless laid out so."""
        check_structure(hf)
        return hf.base_model, getattr(hf, HEAD)

    def _tie_weights(self) -> None:
        if (
            self.args.tie_word_embeddings
            and self.tok_embeddings is not None
            and self.output is not None
            and self.output.weight is not self.tok_embeddings.weight
        ):
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn: Any, recurse: bool = True) -> TransformersModel:
        # As the shared decoder: to_empty / to() give each user of a shared parameter its own copy; tie again. A
        # whole-model cast such as .to(torch.bfloat16) would round the rotary frequencies: recompute them in float32.
        super()._apply(fn, recurse)
        self._tie_weights()
        rounded = [
            (module, name)
            for module in self.modules()
            for name, buffer in module._buffers.items()
            if name in module._non_persistent_buffers_set
            and buffer is not None
            and buffer.is_floating_point()
            and buffer.dtype != torch.float32
            and buffer.device.type != "meta"
        ]
        for module, name in rounded:
            module._buffers[name] = module._buffers[name].float()
        if rounded:
            self.init_buffers(rounded[0][0]._buffers[rounded[0][1]].device)
        return self

    def _install(self) -> None:
        """Hand the base model what this wrapper holds now (its forward reads them as attributes)."""
        parts = self._base.__dict__
        parts["embed_tokens"] = self.tok_embeddings
        parts["layers"] = [self.layers[str(i)] if str(i) in self.layers else _PASS for i in range(self.args.n_layers)]
        parts["norm"] = self.norm if self.norm is not None else _PASS
        for name in self._extra:
            parts[name] = getattr(self, name)

    # ----- forward -----

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        project: bool = True,
        parent_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The shared decoder's forward (``titanium.models.common.decoder.Decoder.forward``): ``tokens`` (or hidden
        states on a pipeline stage without the embedding), positions ``[S]`` or ``[B, S]``, packed documents,
        parent documents, a KV cache; ``project=False`` returns the final hidden states (times the model's logit
        multiplier, which commutes with the projection)."""
        self._install()
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        inputs = {"input_ids": tokens} if self.tok_embeddings is not None else {"inputs_embeds": tokens}
        return self._run_language_model(inputs, positions, document_ids, parent_ids, kv_cache, project)

    def _run_language_model(
        self,
        inputs: dict[str, torch.Tensor],
        positions: torch.Tensor,
        document_ids: torch.Tensor | None,
        parent_ids: torch.Tensor | None,
        kv_cache: KVCache | None,
        project: bool,
        rope: torch.Tensor | None = None,
        blocks: torch.Tensor | None = None,
        **extra: Any,
    ) -> torch.Tensor:
        """The base model over ``inputs`` (ids or embeddings) with titanium's attention context, then the head.
        ``rope``: positions for the rotary embedding where they are not ``positions`` (Qwen's 3-D M-RoPE);
        ``blocks``: spans that attend both ways (``AttentionContext.blocks``); ``extra``: more keyword arguments of
        the base model's forward (cross-attention states)."""
        position_ids = positions if positions.dim() == 2 else positions.unsqueeze(0)
        kwargs: dict[str, Any] = {"position_ids": position_ids if rope is None else rope, "use_cache": False, **extra}
        if self.attention == ATTENTION:
            kwargs[CONTEXT_KWARG] = AttentionContext.build(
                position_ids, document_ids, parent_ids, kv_cache, self.windows, self.attention_backend, blocks,
                self.context_split,
            )  # fmt: skip
        elif kv_cache is not None:  # (its own cache: own_cache.py)
            kwargs.update(decoding_inputs(self._base, self._hf.config, kv_cache, document_ids))
        elif parent_ids is not None and self.mixes_documents:
            raise ValueError(
                f"{self.args.model_type} runs its own attention ({'; '.join(self.fallback_reasons)}), with layers that "
                "are no attention: no shared prompts (the preflight checks refuse the settings that need them)"
            )
        elif document_ids is not None and not self.mixes_documents:
            kwargs["attention_mask"] = own_attention_masks(
                self.args.hf_config, self.attention, position_ids, document_ids, parent_ids
            )
        elif document_ids is not None:
            # Layers that are no attention: one sample per row (the preflight checks refuse packing), its left padding
            # (a rollout row's) masked out as transformers masks padding, so it enters no recurrent state; padding
            # after the sample is never seen by it.
            kwargs["attention_mask"] = (document_ids != PAD_DOCUMENT).long()
        hidden = self._base(**inputs, **kwargs).last_hidden_state
        if self.output is None:
            return hidden
        if not project:
            return hidden if self.logit_multiplier == 1.0 else hidden * self.logit_multiplier
        logits = self.output(hidden)
        if self.logit_multiplier != 1.0:
            logits = logits * self.logit_multiplier
        logits = logits.float()
        cap = self.output.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # ----- initialization -----

    def init_buffers(self, device: torch.device | str) -> None:
        """Recompute the non-persistent buffers (rotary frequencies, embedding scales) on ``device``: they are
        derived from the config, never loaded, and hold garbage after ``to_empty``."""
        for module in self.modules():
            own = [name for name in module._buffers if name in module._non_persistent_buffers_set]
            if not own:
                continue
            for name in own:
                buffer = module._buffers[name]
                if buffer is not None and buffer.device != torch.device(device):
                    module._buffers[name] = torch.empty_like(buffer, device=device)
            with _parameters_aside(module):
                initializer(module, self._hf)._init_weights(module)
            if isinstance(module, MoE):
                module.tokens_per_expert.zero_()  # (its routing bias is persistent: a cast must not reset it)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None, seed: int = 0) -> None:
        """Initialize every parameter present as the model's own ``_init_weights`` does, each unit (embedding,
        layer, norm, head, other top-level module) from a generator seeded by ``seed`` and its name, then the
        buffers. Meant to run after ``to_empty``."""
        device = next((p.device for p in self.parameters()), torch.device("cpu"))
        tied = self.args.tie_word_embeddings and self.tok_embeddings is not None
        for name, unit in self.named_children():
            if name == "layers":
                for key, layer in unit.items():
                    self._init_unit(layer, seed, f"layers.{key}", device)
            elif not (tied and name == "output"):  # (a tied head is the embedding)
                self._init_unit(unit, seed, name, device)
        self._tie_weights()
        self.init_buffers(buffer_device if buffer_device is not None else device)

    def _init_unit(self, unit: nn.Module, seed: int, name: str, device: torch.device) -> None:
        """``_init_weights`` on ``unit``'s modules, children first (as ``transformers`` orders them), under the
        global generator seeded for ``name`` (``_init_weights`` draws from it)."""
        generator = unit_generator(seed, name, device)
        std = float(getattr(self.args.text_config, "initializer_range", 0.02))
        with _seeded(generator, device):
            for module in _children_first(unit):
                initializer(module, self._hf)._init_weights(module)
                if isinstance(module, MoE):  # (titanium's, in a swapped block: transformers does not know it)
                    module.init_weights(std, std)


_PASS = _PassThrough()
_INITIALIZER = "_titanium_initializer"


def mark_initializers(hf: nn.Module) -> None:
    """Each module of ``hf`` remembers the sub-model whose ``_init_weights`` initializes it: the nearest
    ``PreTrainedModel`` at or above it, as ``transformers``' own initialization dispatches (a vision tower's, say, is
    its own). Kept in the module's ``__dict__`` (not a submodule), so copies of the model keep it."""
    from transformers import PreTrainedModel

    def visit(module: nn.Module, owner: nn.Module) -> None:
        owner = module if isinstance(module, PreTrainedModel) else owner
        module.__dict__[_INITIALIZER] = owner
        for child in module.children():
            visit(child, owner)

    visit(hf, hf)


def initializer(module: nn.Module, default: nn.Module) -> nn.Module:
    """The sub-model whose ``_init_weights`` initializes ``module`` (``mark_initializers``), else ``default``."""
    return module.__dict__.get(_INITIALIZER, default)


def _children_first(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _children_first(child)
    yield module


@contextlib.contextmanager
def _seeded(generator: torch.Generator, device: torch.device) -> Iterator[None]:
    """The default generators seeded like ``generator`` inside the block; ``device``'s (and the CPU's) restored
    after."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(generator.initial_seed())
        yield


@contextlib.contextmanager
def _parameters_aside(module: nn.Module) -> Iterator[None]:
    """``module``'s parameters, its submodules' too, replaced by meta stand-ins (which initialization leaves alone)
    inside the block: an ``_init_weights`` branch may draw a child's (SigLIP's embeddings draw their position table),
    which recomputing the buffers would otherwise draw again, from the unseeded generator."""
    saved = [(sub, dict(sub._parameters)) for sub in module.modules()]
    for sub, params in saved:
        for name, param in params.items():
            if param is not None:
                sub._parameters[name] = nn.Parameter(torch.empty(param.shape, device="meta"), param.requires_grad)
    try:
        yield
    finally:
        for sub, params in saved:
            sub._parameters.update(params)


def sliding_windows(layers: nn.ModuleDict, config: Any) -> tuple[int, ...]:
    """The sliding windows the attention layers pass to the attention function (their ``sliding_window``), so a
    forward builds each one's mask once."""
    windows = {getattr(config, "sliding_window", None)}
    for module in layers.modules():
        windows.add(getattr(module, "sliding_window", None))
    return tuple(sorted(w for w in windows if isinstance(w, int) and not isinstance(w, bool) and w > 0))
