"""[validation] in one process: the logged held-out loss equals a direct computation with the trained model, for
pretraining (text windows) and SFT (packed chat samples); validating leaves the training run unchanged."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import REPO, scalars, tiny_args
from titanium.objectives import build_objective
from titanium.objectives.base import IGNORE_INDEX
from titanium.parallel.distributed import shutdown_distributed

STEPS, EVERY, BATCHES = 4, 2, 3

CASES = {
    "pretrain": (),
    "sft": (
        "--training.objective", "sft", "--data.kind", "chat", "--data.path", "assets/tasks/arithmetic/train.jsonl",
        "--validation.path", "assets/tasks/arithmetic/test.jsonl",
    ),
}  # fmt: skip


def direct_validation_loss(trainer) -> float:
    """Cross-entropy of the trained model on the first BATCHES held-out microbatches, summed over the scored
    tokens and divided by their number (the validation data read by a fresh objective, the loss by hand)."""
    cfg = trainer.cfg
    data = dataclasses.replace(cfg.data, path=cfg.validation.path)
    held_out = build_objective(cfg.training.objective, trainer._objective_ctx, data, cfg)
    total, count = 0.0, 0
    with torch.no_grad():
        for _ in range(BATCHES):
            batch = held_out.next_microbatch()
            logits = trainer.model(**batch.model_inputs())
            labels = batch.fields.labels
            total += F.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
            ).item()
            count += int((labels != IGNORE_INDEX).sum())
    return total / count


@pytest.mark.parametrize("objective", list(CASES))
def test_validation_loss_is_the_held_out_cross_entropy(make_trainer, tmp_path, objective):
    common = ("--training.steps", str(STEPS), *CASES[objective])
    validated = make_trainer(
        *tiny_args(tmp_path / "val", *common, "--validation.interval", str(EVERY), "--validation.steps", str(BATCHES))
    )
    validated.train()
    validated.metrics.close()  # (flushes the TensorBoard events)
    losses = scalars(tmp_path / "val/tb", "validation/loss")
    assert sorted(losses) == [2, 4]
    assert losses[4] == pytest.approx(direct_validation_loss(validated), rel=1e-6)
    assert losses[4] < losses[2]  # it learns
    perplexity = scalars(tmp_path / "val/tb", "validation/perplexity")
    assert perplexity[4] == pytest.approx(math.exp(losses[4]), rel=1e-6)
    shutdown_distributed()

    plain = make_trainer(*tiny_args(tmp_path / "plain", *common))
    plain.train()
    plain.metrics.close()
    assert scalars(tmp_path / "plain/tb") == scalars(tmp_path / "val/tb")  # same training losses, bit for bit


def test_dpo_validation_counts_pairs_and_shows_no_perplexity(make_trainer, tmp_path):
    """A DPO loss is a mean over pairs, not a token cross-entropy: no perplexity, and the count is of pairs."""
    pairs = tmp_path / "pairs.jsonl"
    lines = (REPO / "assets/tasks/arithmetic/preference_train.jsonl").read_text().splitlines(keepends=True)
    pairs.write_text("".join(lines[:8]))
    dpo = (
        "--training.objective", "dpo", "--data.kind", "preference", "--data.path", str(pairs),
        "--chat.chat_template", "llama3", "--training.local_batch_size", "2", "--training.steps", "1",
        "--validation.interval", "1", "--validation.steps", "2", "--validation.path", str(pairs),
    )  # fmt: skip
    trainer = make_trainer(*tiny_args(tmp_path / "run", *dpo))
    trainer.train()
    trainer.metrics.close()
    tags = EventAccumulator(str(tmp_path / "run/tb")).Reload().Tags()["scalars"]
    assert {"validation/loss", "validation/pairs"} <= set(tags)
    assert "validation/perplexity" not in tags and "validation/tokens" not in tags
    assert scalars(tmp_path / "run/tb", "validation/pairs") == {1: 4.0}  # 2 microbatches of 2 pairs
    # The objective's metrics over the held-out pairs: at step 1 the policy is 1 step from its reference, so every
    # log-ratio is nearly 0 and the accuracy a count of 4 pairs
    assert {f"validation/dpo/{m}" for m in ("accuracy", "margin", "logp_chosen")} <= set(tags)
    assert scalars(tmp_path / "run/tb", "validation/dpo/accuracy")[1] in (0.0, 0.25, 0.5, 0.75, 1.0)
