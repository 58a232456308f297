"""Asynchronous rollout generation with a bounded policy lag, in one process: the next batch is generated on the
generation thread while the current step trains, every batch is tagged with the version that made it, the weight
sync never overlaps a generation, and the thread changes no result (bitwise against generating in the loop)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch

from tests.helpers import REPO
from tests.unit.test_grpo_objective import _model, _objective
from titanium.data.tokenizer import DEFAULT_TOKENIZER_PATH, TiktokenTokenizer
from titanium.generation.background import GenerationWorker
from titanium.objectives.base import ModelOutput, Prepared
from titanium.objectives.grpo import GRPOObjective
from titanium.objectives.grpo_correction import importance_weights


@pytest.fixture(scope="module")
def tokenizer() -> TiktokenTokenizer:
    return TiktokenTokenizer(str(REPO / DEFAULT_TOKENIZER_PATH))


def _train(
    objective: GRPOObjective,
    model: torch.nn.Module,
    steps: int,
    during_step: Callable[[int], None] = lambda step: None,
) -> list[Prepared]:
    """``steps`` steps as the loop runs them: prepare, forward, backward, a large SGD step (so stale weights
    show), ``during_step(step)`` after the optimizer step, then the weight sync."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    served = []
    for step in range(1, steps + 1):
        prepared = objective.prepare([objective.next_microbatch()])
        for microbatch in prepared.batches:
            output = ModelOutput(logits=model(**microbatch.model_inputs()))
            objective.loss(output, microbatch).loss_sum.backward()
        optimizer.step()
        optimizer.zero_grad()
        during_step(step)
        objective.source.policy.updated(step)  # the loop's after_optimizer_step
        served.append(prepared)
    objective.close()
    return served


def _rows(prepared: Prepared) -> list[torch.Tensor]:
    """What a step trains on: tokens, old log-probs, advantages, loss mask, importance weights."""
    out = []
    for mb in prepared.batches:
        f = mb.fields
        out += [mb.tokens, f.old_logprobs, f.advantages, f.loss_mask]
        out += [f.is_weights] if f.is_weights is not None else []
    return out


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_the_generation_thread_changes_no_result(tokenizer, lag) -> None:
    """Generating on the thread (lag > 0) or in the loop (the synchronous path) serves bitwise the same rows and
    lags at every step, through real updates; with lag 0 no thread is used at all."""
    settings = {"max_policy_lag": lag, "minibatches": 2, "old_logprobs": "recompute", "is_correction": "token_truncate"}
    runs = []
    for background in (True, False):
        model = _model(tokenizer.vocab_size)
        objective = _objective(tokenizer, model, **settings)
        assert objective.source.worker.background == (lag > 0)
        if not background:
            objective.source.worker = GenerationWorker(background=False)
        runs.append(_train(objective, model, 5))
    for threaded, inline in zip(*runs):
        assert threaded.metrics["grpo/policy_lag"][0] == inline.metrics["grpo/policy_lag"][0]
        for a, b in zip(_rows(threaded), _rows(inline), strict=True):
            assert torch.equal(a, b)


def thirds(completion: str, answer: str | None, row: Mapping[str, Any]) -> float:
    """A reward that often gives a group of random responses equal rewards (so dynamic sampling draws again)."""
    return float(len(completion) % 3 == 0)


@pytest.mark.parametrize("lag", [1, 2])
def test_dynamic_sampling_with_a_lag_draws_its_rounds_as_without_a_thread(tokenizer, lag) -> None:
    """Dynamic sampling's refill rounds run inside the batch's generation job, on the thread: the prompts, seeds
    and rows served equal generating in the loop (bitwise, through real updates), refills happen, every round of
    a batch is made by one engine version, and no batch is first trained on more than ``lag`` updates later."""
    settings = {
        "max_policy_lag": lag,
        "minibatches": 2,
        "dynamic_sampling": True,
        "dynamic_sampling_max_rounds": 3,
        "rewards": [f"{__name__}:thirds"],
        "old_logprobs": "recompute",
        "is_correction": "token_truncate",
    }
    runs, made = [], []
    for background in (True, False):
        model = _model(tokenizer.vocab_size)
        objective = _objective(tokenizer, model, stop_every=64, **settings)
        if not background:
            objective.source.worker = GenerationWorker(background=False)
        versions: dict[int, int] = {}
        sample = objective.source.sample

        def recording(samples, index, objective=objective, sample=sample, versions=versions):
            rollout, version = sample(samples, index)
            versions[index] = version
            return rollout, version

        objective.source.sample = recording
        runs.append(_train(objective, model, 5))
        made.append(objective.source.batches_made)
        name = "grpo/generation_rounds"
        rounds = [p.metrics[name][0].item() for p in runs[-1] if name in p.metrics]
        assert len(rounds) == 3 and sum(rounds) > 3, rounds  # (batches first used at steps 1, 3, 5) refills drawn
        lags = [p.metrics["grpo/policy_lag"][0].item() / p.metrics["grpo/policy_lag"][1].item() for p in runs[-1]]
        assert max(lags) <= lag + 1  # (the second minibatch of a batch is one more update later)
    assert made[0] == made[1]
    for threaded, inline in zip(*runs):
        assert threaded.metrics["grpo/policy_lag"][0] == inline.metrics["grpo/policy_lag"][0]
        for name in ("grpo/generation_rounds", "grpo/zero_std_trained"):  # (at the steps that first used a batch)
            assert (name in threaded.metrics) == (name in inline.metrics)
            assert name not in inline.metrics or threaded.metrics[name][0] == inline.metrics[name][0]
        for a, b in zip(_rows(threaded), _rows(inline), strict=True):
            assert torch.equal(a, b)


def test_with_lag_1_batches_stay_within_the_lag_and_is_weights_use_the_engine_logprobs(tokenizer) -> None:
    """Every batch carries the version of the engine weights that generated it, is first trained on at most one
    update later, and its importance weights compare the policy's log-probs at first use with the engine's."""
    model = _model(tokenizer.vocab_size)
    objective = _objective(
        tokenizer,
        model,
        stop_every=16,
        max_policy_lag=1,
        old_logprobs="recompute",
        is_correction="token_truncate",
        is_cap=2.0,
    )
    engine_out: dict[int, tuple[torch.Tensor, int]] = {}
    sample = objective.source.sample

    def recording(samples, index):
        rollout, version = sample(samples, index)
        assert version == objective.source.engine.version  # (no sync while it generates)
        engine_out[index] = (rollout.old_logprobs.clone(), version)
        return rollout, version

    objective.source.sample = recording
    batches = []

    def check(step: int) -> None:
        batch = objective.source.current
        batches.append(batch)
        assert step - 1 - batch.version <= 1  # lag at this step's prepare (version step - 1)

    served = _train(objective, model, 5, check)
    lags = [p.metrics["grpo/policy_lag"][0].item() / p.metrics["grpo/policy_lag"][1].item() for p in served]
    assert lags == [0, 1, 1, 1, 1]  # the first batch is made at once, each later one during the step before
    for index, batch in enumerate(batches):
        engine_logprobs, version = engine_out[index]
        assert batch.version == version == max(index - 1, 0)
        (microbatch,) = served[index].batches
        mask = microbatch.fields.loss_mask
        expected = importance_weights(microbatch.fields.old_logprobs, engine_logprobs, mask, "token_truncate", 2.0)
        assert torch.equal(microbatch.fields.is_weights, expected)
    stale = [p.batches[0].fields.is_weights for p in served[1:]]  # one update behind: weights away from 1
    assert any(not torch.equal(w, torch.ones_like(w)) for w in stale)


def test_the_next_batch_is_generated_while_the_step_trains(tokenizer) -> None:
    """lag 1: batch k + 1's generation starts in step k's prepare and cannot end before step k's optimizer step
    has run (it waits for it here, so a generation inside prepare would never return); the sync after the step
    waits for it before loading any weight."""
    model = _model(tokenizer.vocab_size)
    objective = _objective(tokenizer, model, max_policy_lag=1)
    started, release = threading.Event(), threading.Event()
    generate = objective.source.engine.generate

    def gated(prompts, params, seed):
        if objective.source.batches_made > 1:  # batch 1 on: held until the step that overlaps it has stepped
            started.set()
            assert release.wait(timeout=120), "generation was not overlapped with training"
        return generate(prompts, params, seed)

    objective.source.engine.generate = gated
    load_weights, loads = objective.source.engine.load_weights, []

    def timed_load(weights) -> None:
        loads.append(time.perf_counter())
        load_weights(weights)

    objective.source.engine.load_weights = timed_load
    stepped: list[float] = []

    def during_step(step: int) -> None:
        if step == 1:
            assert started.wait(timeout=120)  # generating while this step trained
            stepped.append(time.perf_counter())
            release.set()

    served = _train(objective, model, 2, during_step)
    events = {(name, key): t for name, key, t in objective.source.timeline}
    assert events[("generate", 1)] < stepped[0] < events[("generated", 1)] < min(t for t in loads if t > stepped[0])
    assert events[("sync", 1)] < events[("generated", 1)]  # the sync began, then waited for the generation
    assert "grpo/time/wait" in served[1].metrics and "grpo/time/generate" in served[1].metrics
