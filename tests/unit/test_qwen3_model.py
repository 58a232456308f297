"""Qwen3 dense: published parameter counts, registry, FLOPs, QK-norm and head_dim plumbing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titanium.models import build_model_args, get_model_spec, list_models
from titanium.models.flops import count_params_on_meta
from titanium.models.llama3 import LLAMA3_FLAVORS, Transformer
from titanium.models.qwen3 import QWEN3_FLAVORS, Qwen3Transformer, qwen3_flops_per_token

# Exact totals of the published Qwen/Qwen3-* checkpoints (sum of the tensor sizes their config.json
# implies; a tied embedding counted once), and the sizes their model cards state (total, non-embedding).
PUBLISHED = {
    "0.6B": (596_049_920, "0.6B", "0.44B"),
    "1.7B": (1_720_574_976, "1.7B", "1.4B"),
    "4B": (4_022_468_096, "4.0B", "3.6B"),
    "8B": (8_190_735_360, "8.2B", "6.95B"),
    "14B": (14_768_307_200, "14.8B", "13.2B"),
    "32B": (32_762_123_264, "32.8B", "31.2B"),
}


def _closed_form(a) -> int:
    """The count written out from the config.json fields, independent of the module code."""
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    attention = a.dim * q + 2 * a.dim * kv + q * a.dim + 2 * a.head_dim
    per_layer = attention + 3 * a.dim * a.ffn_dim + 2 * a.dim
    embeddings = a.vocab_size * a.dim * (1 if a.tie_word_embeddings else 2)
    return a.n_layers * per_layer + a.dim + embeddings


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_parameter_counts_match_published(flavor: str) -> None:
    args = QWEN3_FLAVORS[flavor]
    total, card_total, card_non_embedding = PUBLISHED[flavor]
    assert count_params_on_meta(Qwen3Transformer, args) == total == _closed_form(args)
    non_embedding = total - args.vocab_size * args.dim * (1 if args.tie_word_embeddings else 2)
    digits = len(card_total.split(".")[1].rstrip("B")) if "." in card_total else 0
    assert f"{total / 1e9:.{digits}f}B" == card_total
    digits = len(card_non_embedding.split(".")[1].rstrip("B"))
    assert f"{non_embedding / 1e9:.{digits}f}B" == card_non_embedding


def test_published_hyperparameters() -> None:
    for name, args in QWEN3_FLAVORS.items():
        if name == "debugmodel":
            continue
        assert (args.head_dim, args.n_kv_heads, args.rope_theta, args.norm_eps) == (128, 8, 1e6, 1e-6)
        assert args.vocab_size == 151936 and args.max_seq_len == 40960
        assert args.tie_word_embeddings == (name in ("0.6B", "1.7B", "4B"))


def test_registered_with_adapter_and_plan() -> None:
    assert "qwen3" in list_models()
    spec = get_model_spec("qwen3")
    assert spec.model_cls is Qwen3Transformer and spec.hf_adapter is not None and spec.tp_plan is not None
    assert set(spec.flavors) == {"debugmodel", "0.6B", "1.7B", "4B", "8B", "14B", "32B"}
    args = build_model_args(spec, "8B", vocab_size=1000, max_seq_len=512)
    assert (args.vocab_size, args.max_seq_len, args.head_dim) == (1000, 512, 128)


def test_flops_per_token() -> None:
    a = QWEN3_FLAVORS["8B"]
    non_embedding = 8_190_735_360 - a.vocab_size * a.dim  # the output projection still costs FLOPs
    expected = 6 * non_embedding + 12 * a.n_layers * a.n_heads * a.head_dim * 4096
    assert qwen3_flops_per_token(a, 4096) == expected


def test_qk_norm_and_decoupled_head_dim() -> None:
    args = dataclasses.replace(QWEN3_FLAVORS["debugmodel"], n_layers=2, head_dim=48, max_seq_len=32)
    model = Qwen3Transformer(args)
    torch.manual_seed(0)
    model.init_weights()
    attn = model.layers["0"].attention
    assert attn.wq.weight.shape == (args.n_heads * 48, args.dim) and attn.q_norm.weight.shape == (48,)
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, args.vocab_size)
    # The norm is per head and ahead of RoPE: scaling a head's query rows changes nothing.
    with torch.no_grad():
        attn.wq.weight[:48] *= 7.0
    scaled = model(tokens)
    torch.testing.assert_close(scaled, logits, atol=2e-5, rtol=0)
    scaled.sum().backward()
    assert attn.q_norm.weight.grad is not None and attn.k_norm.weight.grad.abs().sum() > 0


def test_llama_is_unchanged() -> None:
    """QK-norm is off for Llama: no new parameters, and the published sizes still hold."""
    names = [
        n for n, _ in Transformer(dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], n_layers=1)).named_parameters()
    ]
    assert not any("norm" in n and "attention." in n for n in names)
    assert count_params_on_meta(Transformer, LLAMA3_FLAVORS["8B"]) == 8_030_261_248
