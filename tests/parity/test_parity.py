"""Every model titanium ships matches its Hugging Face original: logits, gradients, round trip.

To add a family: append ``ParityCase``s (a tiny ``transformers`` config of the same architecture).
Tolerances (fp32): logits max abs diff <= 1e-5, gradients <= 1e-6.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.parity.harness import (
    GRAD_ATOL,
    LOGIT_ATOL,
    ParityCase,
    assert_round_trip,
    grad_diffs,
    load_titanium,
    make_hf_checkpoint,
    max_logit_diff,
    random_tokens,
)

transformers = pytest.importorskip("transformers")

VOCAB = 256


def _rope(theta: float, scaling: dict | None) -> dict:
    """RoPE settings for a transformers 4 or 5 config."""
    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": theta}}
    return {"rope_theta": theta, "rope_scaling": scaling}


LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama(n_kv_heads: int, tied: bool) -> ParityCase:
    def config():
        return transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=n_kv_heads,
            vocab_size=VOCAB,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            tie_word_embeddings=tied,
            **_rope(500000.0, LLAMA31_SCALING),
        )

    kind = "gqa" if n_kv_heads < 4 else "mha"
    return ParityCase(
        id=f"llama3-{kind}-{'tied' if tied else 'untied'}",
        model="llama3",
        hf_model=lambda: transformers.LlamaForCausalLM,
        hf_config=config,
    )


def qwen3(tied: bool) -> ParityCase:
    def config():
        return transformers.Qwen3Config(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,  # != hidden_size / heads: Qwen3 decouples them
            vocab_size=VOCAB,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            tie_word_embeddings=tied,
            **_rope(1_000_000.0, None),
        )

    return ParityCase(
        id=f"qwen3-{'tied' if tied else 'untied'}",
        model="qwen3",
        hf_model=lambda: transformers.Qwen3ForCausalLM,
        hf_config=config,
    )


def qwen2(tied: bool, kv_heads: int) -> ParityCase:
    """Qwen2/2.5: q/k/v biases (random too, so the RoPE permutation of the q/k biases is checked)."""

    def config():
        return transformers.Qwen2Config(
            hidden_size=64,
            intermediate_size=112,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=kv_heads,
            vocab_size=VOCAB,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            tie_word_embeddings=tied,
            use_sliding_window=False,
            **_rope(1_000_000.0, None),
        )

    return ParityCase(
        id=f"qwen2-kv{kv_heads}-{'tied' if tied else 'untied'}",
        model="qwen2",
        hf_model=lambda: transformers.Qwen2ForCausalLM,
        hf_config=config,
    )


def mistral(window: int | None, head_dim: int) -> ParityCase:
    """Mistral: v0.3 (no window) and v0.1's sliding window (8 tokens of the 24: the window masks), NeMo's
    head_dim != hidden / heads."""

    def config():
        return transformers.MistralConfig(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=head_dim,
            vocab_size=VOCAB,
            max_position_embeddings=32768,
            rms_norm_eps=1e-5,
            sliding_window=window,
            **_rope(1_000_000.0, None),
        )

    return ParityCase(
        id=f"mistral-{'window' if window else 'global'}-hd{head_dim}",
        model="mistral",
        hf_model=lambda: transformers.MistralForCausalLM,
        hf_config=config,
    )


def phi3(window: int | None, kv_heads: int) -> ParityCase:
    """Phi-3 (fused qkv_proj / gate_up_proj, split on load): mini's sliding window (8 of 24 tokens) with MHA, and
    Phi-4's global attention with GQA."""

    def config():
        return transformers.Phi3Config(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=kv_heads,
            vocab_size=VOCAB,
            max_position_embeddings=4096,
            original_max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            sliding_window=window,
            pad_token_id=0,
            **_rope(250_000.0 if window is None else 10_000.0, None),
        )

    return ParityCase(
        id=f"phi3-{'window' if window else 'global'}-kv{kv_heads}",
        model="phi3",
        hf_model=lambda: transformers.Phi3ForCausalLM,
        hf_config=config,
    )


def gemma2(softcaps: tuple[float, float], window: int, layer_types: list[str] | None, tied: bool) -> ParityCase:
    """Gemma 2: (1 + w) norms before and after attention and MLP, GeGLU, sqrt(dim)-scaled embeddings, queries
    scaled by query_pre_attn_scalar (!= head_dim), soft-capped attention and output logits (the published 50/30,
    and small caps that bite harder on these random weights), sliding-window layers (6 or 8 of the 24 tokens)
    in Gemma 2's alternation (None) or another order (``layer_types``). The reference runs transformers' eager
    attention, its only soft-capping one."""

    def config():
        return transformers.Gemma2Config(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            vocab_size=VOCAB,
            max_position_embeddings=8192,
            rms_norm_eps=1e-6,
            tie_word_embeddings=tied,
            query_pre_attn_scalar=20,
            attn_logit_softcapping=softcaps[0],
            final_logit_softcapping=softcaps[1],
            sliding_window=window,
            layer_types=layer_types,
            attn_implementation="eager",
            **_rope(10_000.0, None),
        )

    return ParityCase(
        id=f"gemma2-caps{softcaps[0]:g}-{softcaps[1]:g}-{'global-first' if layer_types else 'window-first'}",
        model="gemma2",
        hf_model=lambda: transformers.Gemma2ForCausalLM,
        hf_config=config,
    )


CASES = [
    llama(n_kv_heads=2, tied=False),
    llama(n_kv_heads=4, tied=False),
    llama(n_kv_heads=2, tied=True),
    llama(n_kv_heads=4, tied=True),
    qwen3(tied=True),
    qwen3(tied=False),
    qwen2(tied=True, kv_heads=2),
    qwen2(tied=False, kv_heads=1),
    mistral(window=None, head_dim=16),
    mistral(window=8, head_dim=24),
    phi3(window=8, kv_heads=4),
    phi3(window=None, kv_heads=2),
    gemma2(softcaps=(1.5, 2.0), window=8, layer_types=None, tied=True),
    gemma2(softcaps=(50.0, 30.0), window=6, layer_types=["full_attention", "sliding_attention"], tied=False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_transformers(case: ParityCase, tmp_path: Path) -> None:
    source = tmp_path / "hf"
    hf_model = make_hf_checkpoint(case, source)
    assert len(list(source.glob("*.safetensors"))) >= 2, "the fixture must be sharded"
    model, args, ckpt = load_titanium(source, case)
    assert args.tie_word_embeddings == case.hf_config().tie_word_embeddings

    tokens = random_tokens(VOCAB, case.seq_len)
    diff = max_logit_diff(hf_model, model, tokens)
    assert diff <= LOGIT_ATOL, f"{case.id}: logits differ by {diff:.2e}"

    diffs = grad_diffs(case, hf_model.train(), model.train(), args, tokens)
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= GRAD_ATOL, f"{case.id}: gradient of {worst} differs by {diffs[worst]:.2e}"

    assert_round_trip(case, source, tmp_path / "out", model, args, ckpt)
    # What we wrote is a checkpoint transformers itself loads, with the same outputs.
    reloaded = case.hf_model().from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=tokens).logits, hf_model.eval()(input_ids=tokens).logits)
