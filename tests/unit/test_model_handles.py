"""Model handles in the loop: which models exist, when, and what they compute.

- A DPO reference used only to precompute its log-probs is freed once the cache exists: one model is left.
- A reference that drops a converter that cannot be switched off (float8) next to one that can (LoRA) is a
  separate copy of the starting policy, not a crash.
- With LoRA alone the reference is the policy with its adapters off: no second model is built.
- Hooks registered by the model family and by a policy handle's owner are called by the loop.
"""

from __future__ import annotations

import gc
import math
import weakref
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, scalars, tiny_args
from titanium import moe_balance
from titanium.config.sections import MoESection
from titanium.model_builder import ModelBuilder


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


def test_registered_training_hooks_and_a_policy_follower_are_called(make_trainer, tmp_path, monkeypatch):
    """A component registered in ``TRAINING_HOOKS`` (here in place of the [moe] load balancing, which registers the
    same three kinds) is built from its own section; its loss term is added to every training microbatch's loss
    before the backward, its after-step hook runs after every optimizer step, and its metrics are logged. A policy
    handle's ``on_update`` (as a rollout engine's weight sync would) runs once the weights are in place, then after
    every step. The loop names none of them."""
    calls, terms = [], []

    def register(section, ctx, hooks):
        assert isinstance(section, MoESection) and ctx.microbatches == 2
        weight = next(p for p in ctx.built.model.parameters() if p.requires_grad)

        def term(batch):
            terms.append(batch.tokens.shape)
            return 0.5 * weight.sum()

        hooks.loss_term.register(term)
        hooks.after_optimizer_step.register(calls.append)
        hooks.metrics.register(lambda step: {"test/hooked": float(step)})

    monkeypatch.setattr(moe_balance, "register_load_balancing", register)
    follower = ("--training.objective", "tests.objectives.following:PolicyFollower")
    args = tiny_args(tmp_path, *follower, "--data.kind", "synthetic", "--training.steps", "3")
    trainer = make_trainer(*args, "--training.global_batch_size", "4", "--training.local_batch_size", "2")
    trainer.train()
    assert calls == [1, 2, 3] and len(terms) == 6  # one term per microbatch, 2 microbatches per step
    assert trainer.objective.updates == [0, 1, 2, 3]
    trainer.metrics.close()  # (flushes the TensorBoard events)
    assert scalars(tmp_path / "tb", "test/hooked") == {1: 1.0, 2: 2.0, 3: 3.0}
