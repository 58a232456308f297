"""Model registry and flavor selection."""

from __future__ import annotations

import dataclasses

import pytest

from titanium.models import (
    ModelSpec,
    build_model_args,
    get_model_spec,
    list_models,
    register_model,
)
from titanium.models.llama3 import LLAMA3_FLAVORS, Transformer


def test_llama3_is_registered() -> None:
    assert "llama3" in list_models()
    spec = get_model_spec("llama3")
    assert spec.name == "llama3"
    assert spec.model_cls is Transformer
    assert set(spec.flavors) == {"debugmodel", "1B", "3B", "8B", "70B", "405B"}
    assert spec.tp_plan is not None and spec.hf_adapter is not None


def test_unknown_model_lists_known_models() -> None:
    with pytest.raises(ValueError, match="unknown model 'gpt5'.*llama3"):
        get_model_spec("gpt5")


def test_unknown_flavor_lists_valid_flavors() -> None:
    spec = get_model_spec("llama3")
    with pytest.raises(ValueError, match="unknown flavor '7B'") as excinfo:
        build_model_args(spec, "7B")
    for flavor in LLAMA3_FLAVORS:
        assert flavor in str(excinfo.value)


def test_build_model_args_overrides_without_touching_preset() -> None:
    spec = get_model_spec("llama3")
    preset = spec.flavors["debugmodel"]
    args = build_model_args(spec, "debugmodel", vocab_size=1000, max_seq_len=512)
    assert (args.vocab_size, args.max_seq_len) == (1000, 512)
    assert args.dim == preset.dim
    assert preset.vocab_size == 2256 and preset.max_seq_len == 2048
    assert build_model_args(spec, "8B") == LLAMA3_FLAVORS["8B"]


def test_build_model_args_rejects_unknown_fields() -> None:
    with pytest.raises(ValueError, match="hidden_size"):
        build_model_args(get_model_spec("llama3"), "debugmodel", hidden_size=8)


def test_register_rejects_duplicate_names() -> None:
    spec = get_model_spec("llama3")
    assert register_model(spec) is spec
    imposter = dataclasses.replace(spec, flavors={})
    with pytest.raises(ValueError, match="already registered"):
        register_model(imposter)
    assert get_model_spec("llama3") is spec


def test_register_new_model() -> None:
    spec = ModelSpec(
        name="_test_only_model",
        model_cls=Transformer,
        flavors={"tiny": LLAMA3_FLAVORS["debugmodel"]},
        flops_per_token=lambda args, seq_len: 0.0,
    )
    try:
        register_model(spec)
        assert get_model_spec("_test_only_model") is spec
        assert "_test_only_model" in list_models()
    finally:
        from titanium.models.registry import _REGISTRY

        _REGISTRY.pop("_test_only_model", None)


def test_published_flavor_hyperparameters() -> None:
    f = LLAMA3_FLAVORS
    assert f["debugmodel"].kv_heads == 4 and f["debugmodel"].rope_scaling is not None
    assert f["1B"].tie_word_embeddings and f["3B"].tie_word_embeddings
    assert not f["8B"].tie_word_embeddings
    for name in ("1B", "3B"):
        assert f[name].rope_scaling.factor == 32.0
    for name in ("8B", "70B", "405B"):
        assert f[name].rope_scaling.factor == 8.0
    for name in ("1B", "3B", "8B", "70B", "405B"):
        a = f[name]
        assert (a.vocab_size, a.max_seq_len, a.norm_eps, a.rope_theta) == (128256, 131072, 1e-5, 500000.0)
        assert a.kv_heads == 8
        s = a.rope_scaling
        assert (s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings) == (1.0, 4.0, 8192)
