"""The loop in one process: the loss rule under gradient accumulation, and exact resume."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers import scalars, tiny_args, train_until_first_save
from titanium.batch import Batch
from titanium.objectives.losses.cross_entropy import TokenFields
from titanium.parallel.distributed import shutdown_distributed
from titanium.trainer import Trainer


def grads_after_one_step(trainer: Trainer) -> dict[str, torch.Tensor]:
    microbatches = [trainer.objective.next_microbatch() for _ in range(trainer.grad_accum_steps)]
    trainer.forward_backward(microbatches)
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("kind", ["text", "synthetic"])
def test_grad_accumulation_equals_full_batch(make_trainer, tmp_path, kind):
    """1 microbatch of 8 and 8 microbatches of 1 give the same gradient (fp32 rounding)."""
    full = make_trainer(*tiny_args(tmp_path / "a", "--data.kind", kind, "--training.local_batch_size", "8"))
    reference = grads_after_one_step(full)
    shutdown_distributed()
    accumulated = make_trainer(
        *tiny_args(
            tmp_path / "b", "--data.kind", kind,
            "--training.local_batch_size", "1", "--training.global_batch_size", "8",
        )
    )  # fmt: skip
    assert accumulated.grad_accum_steps == 8
    grads = grads_after_one_step(accumulated)
    for name, ref in reference.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-7, msg=name)


def test_grad_accumulation_is_a_token_mean_with_padding(make_trainer, tmp_path):
    """Microbatches with different numbers of valid tokens: the step is the mean over all valid tokens."""
    trainer = make_trainer(*tiny_args(tmp_path, "--data.kind", "synthetic", "--training.local_batch_size", "2"))
    a, b = trainer.objective.next_microbatch(), trainer.objective.next_microbatch()
    b.fields.labels[:, 10:] = -100  # second microbatch mostly padding
    trainer.forward_backward([a, b])
    accumulated = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    trainer.optimizer.zero_grad()
    both = Batch(torch.cat([a.tokens, b.tokens]), TokenFields(torch.cat([a.fields.labels, b.fields.labels])))
    trainer.forward_backward([both])
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(accumulated[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_resume_continues_bitwise(make_trainer, tmp_path):
    """Train 6 steps saving at 3; a fresh trainer resumed from step 3 logs identical losses for 4-6."""
    common = ("--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "3", "--debug.deterministic")
    straight = make_trainer(*tiny_args(tmp_path / "straight", *common))
    straight.train()
    expected = scalars(tmp_path / "straight/tb")
    shutdown_distributed()

    train_until_first_save(make_trainer, *tiny_args(tmp_path / "resumed", *common))  # dies after its step-3 checkpoint
    resumed = make_trainer(*tiny_args(tmp_path / "resumed", *common))
    assert resumed.train_state.step == 3
    resumed.train()
    got = scalars(tmp_path / "resumed/tb")
    assert [got[s] for s in (4, 5, 6)] == [expected[s] for s in (4, 5, 6)]


def test_the_objectives_counters_reach_the_console_line(make_trainer, tmp_path, caplog):
    """What an objective counts on the host (GRPO's long prompts and stale rollouts) is on the console line, by
    its last part, as docs/post_training.md says; a counter the line shows already is not repeated."""
    trainer = make_trainer(*tiny_args(tmp_path, "--data.kind", "synthetic", "--training.steps", "1"))
    counters = {"data/skipped_rows": 2.0, "grpo/long_prompts_skipped": 3.0, "grpo/stale_rollouts_dropped": 1.0}
    trainer.objective.log_metrics = lambda: counters
    with caplog.at_level(logging.INFO, logger="titanium"):
        trainer.train()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("step"))
    assert "long_prompts_skipped 3" in line and "stale_rollouts_dropped 1" in line
    assert line.count("skipped_rows 2") == 1
