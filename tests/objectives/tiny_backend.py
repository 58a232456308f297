"""Tiny random Hugging Face models of architectures titanium has no native family for, made with ``transformers``
(no hub): what the transformers backend's tests train, export and compare with ``transformers``' own forward.

Each config is a real architecture at toy size (2 layers, width 64, the debug tokenizer's 2256 ids), with the
features that make it differ from Llama switched on: Gemma 3's sliding windows (shorter than the test rows),
(1 + w) norms, scaled embeddings, q/k norms and soft-capped logits; Granite's embedding, residual, attention and
logit multipliers; OLMo 2's norms after attention and MLP and its whole-projection q/k norms; SmolLM3's layers
without RoPE; DeepSeek-V3's latent attention (MLA) and MoE layers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.parity.harness import randomize_

VOCAB = 2256
"""The debug tokenizer's ids (assets/tokenizer/titanium_debug.tiktoken)."""
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
ARCHITECTURES = {
    "gemma3_text": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "final_logit_softcapping": 3.0,
        },
    ),
    "granite": (
        "GraniteConfig",
        {"logits_scaling": 4.0, "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.3},
    ),
    "olmo2": ("Olmo2Config", {}),
    "smollm3": ("SmolLM3Config", {"no_rope_layer_interval": 2}),
    "llama": ("LlamaConfig", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            "num_key_value_heads": 4,
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
        },
    ),
}
"""model_type -> (config class, what differs from ``SHAPE``): models that run titanium's attention."""
OWN_ATTENTION = {
    "gpt_oss": (
        "GptOssConfig",
        {
            "head_dim": 16,
            "intermediate_size": 64,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "qwen3_5_text": (
        "Qwen3_5TextConfig",
        {
            "head_dim": 16,
            "layer_types": ["linear_attention", "full_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
        },
    ),
}
"""Models that run their own attention (``titanium/models/transformers/support.py``): GPT-OSS (attention sinks, with
sliding windows shorter than the test rows and MoE), Qwen3.5 (linear-attention layers)."""


def tiny_config(model_type: str, **changes: Any) -> Any:
    """The ``transformers`` config of a tiny ``model_type`` (``ARCHITECTURES``), with ``changes``."""
    import transformers

    name, extra = {**ARCHITECTURES, **OWN_ATTENTION}[model_type]
    fields = {**SHAPE, **extra, **changes}
    return getattr(transformers, name)(**fields)


def tiny_hf_model(model_type: str, seed: int = 0, **changes: Any) -> Any:
    """A float32 ``transformers`` causal LM of ``tiny_config(model_type)``, every weight random (``randomize_``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **changes), dtype=torch.float32)
    randomize_(model, seed)
    return model.eval()


def save_tiny_hf(folder: Path, model_type: str, seed: int = 0, **changes: Any) -> Any:
    """``tiny_hf_model`` saved as a Hugging Face folder (with a tokenizer_config.json naming the debug tokenizer's
    end of text); returns the model."""
    model = tiny_hf_model(model_type, seed, **changes)
    model.save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
    return model
