"""A tiny random config of every causal-LM ``model_type`` the installed ``transformers`` knows, derived from the config
class's own defaults: the size fields shrunk (``SIZES``), two representative layers kept of every per-layer field,
token ids inside the small vocabulary, and, where that alone does not make a config ``transformers`` accepts (or
leaves out what makes the architecture what it is), a few values per ``model_type`` (``OVERRIDES``).

Two layers, width 64, the debug tokenizer's 2256 ids: big enough to exercise every feature (grouped heads, windows
shorter than the test rows, two kinds of layers, several experts), small enough that a cell costs a fraction of a
second.
"""

from __future__ import annotations

import copy
from typing import Any

VOCAB = 2256
"""The debug tokenizer's ids (assets/tokenizer/titanium_debug.tiktoken): the layout jobs train on its tokens."""
LAYERS = 2
SIZES: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "sliding_window": 8,
    # MoE: 8 experts, 2 per token, narrow experts; one dense layer first where the architecture has dense first layers
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 8,
    "n_routed_experts": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    # latent attention (MLA)
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "qk_head_dim": 24,
    # linear-attention and state-space layers
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    # GPT-2-style names
    "n_embd": 64,
    "n_layer": LAYERS,
    "n_head": 4,
    "n_positions": 512,
    "d_model": 64,
}
"""Size fields (wherever a config class has them) and their tiny values."""
DERIVED = frozenset({"head_dim", "num_key_value_heads"})
"""Size fields whose default None means "derived" (from the width and heads): set like the others."""
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

OVERRIDES: dict[str, dict[str, Any]] = {
    # one sliding and one global layer (the generic pick keeps both kinds where layer_types lists them)
    "gemma2": {"final_logit_softcapping": 3.0, "attn_logit_softcapping": 5.0},
    "gemma3_text": {"final_logit_softcapping": 3.0},
    "smollm3": {"no_rope_layer_interval": 2},
    "granite": {"logits_scaling": 4.0, "embedding_multiplier": 2.0, "residual_multiplier": 0.5},
    "qwen3_moe": {"norm_topk_prob": True},
    "qwen3_5_text": {"layer_types": ["linear_attention", "full_attention"]},
    "qwen3_5_moe_text": {"layer_types": ["linear_attention", "full_attention"]},
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention"]},
    "deepseek_v2": {"num_experts_per_tok": 2},  # (its class default is None)
    "gpt_oss": {"intermediate_size": 64, "layer_types": ["sliding_attention", "full_attention"]},
}
"""Per ``model_type``: values the generic derivation cannot know (or that switch on what makes the architecture)."""


def tiny_config_dict(model_type: str) -> dict[str, Any]:
    """The ``config.json`` dict of a tiny ``model_type`` (module docstring); ``transformers`` may still refuse it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    defaults = CONFIG_MAPPING[model_type]().to_dict()
    config = copy.deepcopy(defaults)
    config.update({k: v for k, v in SIZES.items() if k in defaults and (defaults[k] is not None or k in DERIVED)})
    if defaults.get("qk_rope_head_dim") is not None and defaults.get("head_dim") == defaults["qk_rope_head_dim"]:
        config["head_dim"] = SIZES["qk_rope_head_dim"]  # (latent attention: RoPE acts on the rope part of a head)
    if defaults.get("kv_lora_rank") is not None and "num_key_value_heads" in defaults:
        config["num_key_value_heads"] = SIZES["num_attention_heads"]  # (latent attention has a key per head)
    layers = _layer_count(defaults)
    if layers:
        keep = _representative_layers(defaults, layers)
        for key, value in defaults.items():
            if isinstance(value, list) and len(value) == layers:
                config[key] = [value[i] for i in keep]
            elif isinstance(value, dict) and value and all(_layer_index(k, layers) for k in value):
                config[key] = {str(new): value[old] for new, old in enumerate(keep) if old in value}
                if all(isinstance(k, int) for k in value):
                    config[key] = {new: value[old] for new, old in enumerate(keep) if old in value}
    for key, value in defaults.items():
        if key.endswith(("_token_id", "_token_index")) and isinstance(value, int) and value >= VOCAB:
            config[key] = TOKEN_IDS.get(key, 3)
    config.update({k: v for k, v in TOKEN_IDS.items() if k in config})
    config.update(OVERRIDES.get(model_type, {}))
    config.pop("transformers_version", None)
    return config


def _layer_count(config: dict[str, Any]) -> int:
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        value = config.get(key)
        if isinstance(value, int) and value > LAYERS:
            return value
    return 0


def _layer_index(key: object, layers: int) -> bool:
    try:
        return 0 <= int(key) < layers  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return False


def _representative_layers(config: dict[str, Any], layers: int) -> list[int]:
    """Layer 0 and the first layer that differs from it in any per-layer field (else layer 1): a tiny model then
    has both kinds of layers (sliding and global attention, linear and full, dense and MoE)."""
    per_layer = [v for v in config.values() if isinstance(v, list) and len(v) == layers]
    for i in range(1, layers):
        if any(v[i] != v[0] for v in per_layer):
            return [0, i]
    return [0, 1]


def tiny_config(model_type: str) -> Any:
    """The ``transformers`` config object of ``tiny_config_dict(model_type)``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type].from_dict(tiny_config_dict(model_type))
