"""Model handles in the loop: which models exist, when, and what they compute.

- A DPO reference used only to precompute its log-probs is freed once the cache exists: one model is left.
- A reference that drops a converter that cannot be switched off (float8) next to one that can (LoRA) is a
  separate copy of the starting policy, not a crash.
- With LoRA alone the reference is the policy with its adapters off: no second model is built.
- Hooks registered by the model family and by a policy handle's owner are called by the loop.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import weakref
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, scalars, tiny_args
from titanium import model_builder
from titanium.model_builder import ModelBuilder
from titanium.models import get_model_spec


@pytest.fixture
def built_models(monkeypatch) -> list[weakref.ref]:
    """Weak references to every model the builder makes from now on."""
    refs: list[weakref.ref] = []
    build = ModelBuilder.build

    def build_and_remember(self, *args, **kwargs):
        built = build(self, *args, **kwargs)
        refs.append(weakref.ref(built.model))
        return built

    monkeypatch.setattr(ModelBuilder, "build", build_and_remember)
    return refs


def alive(refs: list[weakref.ref]) -> int:
    gc.collect()
    return sum(ref() is not None for ref in refs)


def dpo_args(tmp_path: Path, *extra: str) -> list[str]:
    pairs = tmp_path / "pairs.jsonl"
    lines = (REPO / "assets/tasks/arithmetic/preference_train.jsonl").read_text().splitlines(keepends=True)
    pairs.write_text("".join(lines[:12]))
    return tiny_args(
        tmp_path / "run",
        "--training.objective", "dpo", "--data.kind", "preference", "--data.path", str(pairs),
        "--chat.chat_template", "llama3", "--training.local_batch_size", "2", "--training.steps", "2",
        *extra,
    )  # fmt: skip


def test_a_precomputed_reference_is_freed_once_its_cache_exists(make_trainer, tmp_path, built_models):
    trainer = make_trainer(*dpo_args(tmp_path, "--dpo.precompute_reference"))
    trainer.train()
    assert len(built_models) == 2  # the policy, and the reference for the one pass over the data
    assert alive(built_models) == 1  # the reference is gone: training held one model


def test_lora_and_float8_reference_is_a_copy_without_converters(make_trainer, tmp_path, built_models):
    """LoRA on wq, float8 (emulated) on the other linear layers: float8 cannot be switched off in place, so the
    reference is a separate copy of the starting weights; at step 1 the policy (adapters at zero, float8
    rounding) is the reference up to float8 rounding, so the sigmoid loss is log 2 up to that."""
    lora = ("--lora.rank", "4", "--lora.target_modules", "wq")
    float8 = ("--float8.enable", "--float8.emulate", "--float8.filter_fqns", "output", "wq")
    trainer = make_trainer(*dpo_args(tmp_path, *lora, *float8, "--training.steps", "1"))
    trainer.train()
    assert len(built_models) == 2 and alive(built_models) == 2  # the reference lives while DPO trains
    reference = built_models[1]()
    assert not any(p.requires_grad for p in reference.parameters())
    assert not any("lora" in name for name, _ in reference.named_parameters())
    assert type(reference.layers["0"].attention.wk) is torch.nn.Linear  # no float8 in the reference
    trainer.metrics.close()  # (flushes the TensorBoard events)
    assert scalars(tmp_path / "run/tb")[1] == pytest.approx(math.log(2), abs=1e-2)


def test_lora_reference_is_the_policy_with_adapters_off(make_trainer, tmp_path, built_models):
    trainer = make_trainer(*dpo_args(tmp_path, "--lora.rank", "4", "--training.steps", "1"))
    trainer.train()
    assert len(built_models) == 1  # the policy only


def test_hooks_of_the_model_family_and_of_a_policy_follower_are_called(make_trainer, tmp_path, monkeypatch):
    """A family's ``training_hooks`` (as MoE's router-bias update would) run after every optimizer step; a policy
    handle's ``on_update`` (as a rollout engine's weight sync would) once the weights are in place, then after
    every step; neither is named by the loop."""
    calls = []

    def family_hooks(parts, meshes, hooks):
        assert parts and meshes is not None
        hooks.after_optimizer_step.register(calls.append)

    spec = dataclasses.replace(get_model_spec("llama3"), training_hooks=family_hooks)
    monkeypatch.setattr(model_builder, "get_model_spec", lambda name: spec)
    follower = ("--training.objective", "tests.objectives.following:PolicyFollower")
    trainer = make_trainer(*tiny_args(tmp_path, *follower, "--data.kind", "synthetic", "--training.steps", "3"))
    trainer.train()
    assert calls == [1, 2, 3]
    assert trainer.objective.updates == [0, 1, 2, 3]
