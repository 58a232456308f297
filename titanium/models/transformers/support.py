"""Which attention a backend model runs: titanium's, or, where titanium's cannot compute it, the model's own.

titanium's attention (``attention.py``) computes what a layer's attention function is asked for: scaled dot
products of queries and keys after the model's own RoPE, with grouped heads, a sliding window and soft-capping.
A model asks for more where its attention has sinks (GPT-OSS), dropout, bidirectional spans, or where some
layers are no attention at all (linear attention, state-space layers: Qwen3.5, Jamba...), or where its attention
does not go through ``transformers``' ``AttentionInterface``. Such a model runs its own attention (SDPA where it
offers it, else eager), and what only titanium's attention carries is refused before any process group exists:
packed documents and shared-prompt rows where some layers are no attention, and context parallelism. Such a model
decodes with ``transformers``' own cache (``own_cache.py``).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from torch import nn

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
_NOT_ATTENTION = re.compile(r"Mamba|DeltaNet|LinearAttention|Rwkv|ShortConv", re.IGNORECASE)


def fallback_reasons(model: nn.Module, config: Any) -> list[str]:
    """Why titanium's attention cannot stand in for ``model``'s (a ``transformers`` causal LM, on any device, meta
    included); empty when it can."""
    reasons = []
    if not type(model)._can_set_attn_implementation():
        reasons.append("its attention does not go through transformers' AttentionInterface")
    mixers = non_attention_layers(model, config)
    if mixers:
        reasons.append(f"it has {', '.join(mixers)} layers, which are not attention")
    if any(name.rsplit(".", 1)[-1] == "sinks" for name, _ in model.named_parameters()):
        reasons.append("its attention has sinks")
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        reasons.append(f"attention_dropout {config.attention_dropout} (titanium's attention has none)")
    if getattr(config, "use_bidirectional_attention", False):
        reasons.append("use_bidirectional_attention")
    return reasons + code_reasons(model)


def code_reasons(model: nn.Module) -> list[str]:
    """What the model's code (read, not run: it is on meta) does that titanium's attention cannot follow: a decoder
    layer that does not pass its keyword arguments on to its attention (titanium's masks and KV cache travel as one:
    StableLM, Nemotron), or an attention that computes a mask or bias of its own to attend with (Doge's dynamic
    mask). titanium's attention also refuses, at run time, to be called without its masks or with another mask."""
    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        return []
    reasons = []
    layer = layers[0]
    attentions = [(n, m) for n, m in layer.named_children() if type(m).__name__.endswith("Attention")]
    source = _source(type(layer).forward)
    for name, attention in attentions:
        call = _call_arguments(source, f"self.{name}(")
        if call is not None and "**kwargs" not in call:
            reasons.append(f"its {type(layer).__name__} does not pass titanium's attention context to its {name}")
        if _OWN_MASK.search(_source(type(attention).forward)):
            reasons.append(f"its {type(attention).__name__} builds an attention mask of its own")
    return reasons


_OWN_MASK = re.compile(r"^\s*(attn_mask|attention_mask)\s+=\s", re.MULTILINE)
"""An assignment to the mask inside an attention's forward (formatted code: ``x = y``; a keyword argument is
``x=y``)."""


def _source(function: Any) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def _call_arguments(source: str, call: str) -> str | None:
    """The text between the parentheses of the first ``call`` in ``source``; None when there is none."""
    start = source.find(call)
    if start < 0:
        return None
    depth, begin = 0, start + len(call) - 1
    for i in range(begin, len(source)):
        depth += {"(": 1, ")": -1}.get(source[i], 0)
        if depth == 0:
            return source[begin + 1 : i]
    return None


def non_attention_layers(model: nn.Module, config: Any) -> list[str]:
    """The kinds of ``model``'s layers that mix tokens without attention (linear attention, state spaces): their
    ``layer_types``, else their module classes; empty for a model of attention layers only. Such layers would mix
    the samples of a packed row."""
    kinds = sorted(set(getattr(config, "layer_types", None) or []) - ATTENTION_LAYER_TYPES)
    if kinds:
        return kinds
    return sorted({type(m).__name__ for m in model.modules() if _NOT_ATTENTION.search(type(m).__name__)})


def own_attention(model: nn.Module) -> str:
    """The attention ``model`` runs when titanium's cannot serve it: SDPA where it offers it, else eager."""
    return "sdpa" if getattr(model, "_supports_sdpa", False) else "eager"
