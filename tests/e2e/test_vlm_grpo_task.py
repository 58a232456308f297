"""The bundled image-text task's GRPO (train_configs/debug_vlm_grpo.toml) chained after its SFT as a newcomer runs
the two, kept short: 20 SFT steps with a checkpoint, then 3 GRPO steps from it on 12 held-out rows. The GRPO job
loads the SFT checkpoint (its held-out exact match before the first step is the SFT job's after its last), trains
with finite losses and rewards on prompts whose pictures go through the engine, and measures exact match again
(the full runs' numbers are in docs/vision.md)."""

from __future__ import annotations

import math
from pathlib import Path

from tests.helpers import REPO, run_train, scalars

SFT_STEPS, GRPO_STEPS = 20, 3


def test_debug_vlm_grpo_runs_from_the_sft_checkpoint(tmp_path: Path) -> None:
    sft, grpo = tmp_path / "sft", tmp_path / "grpo"
    args = ["--job.config_file", str(REPO / "train_configs/debug_vlm_sft.toml"), "--job.dump_folder", str(sft)]
    args += ["--job.no_print_config", "--training.steps", str(SFT_STEPS), "--eval.interval", str(SFT_STEPS)]
    args += ["--eval.max_samples", "12", "--checkpoint.enable", "--checkpoint.interval", str(SFT_STEPS)]
    run_train(args, timeout=600)
    args = ["--job.config_file", str(REPO / "train_configs/debug_vlm_grpo.toml"), "--job.dump_folder", str(grpo)]
    args += ["--job.no_print_config", "--training.steps", str(GRPO_STEPS), "--metrics.log_freq", "1"]
    args += ["--eval.interval", str(GRPO_STEPS), "--eval.max_samples", "12"]
    args += ["--checkpoint.initial_load_path", str(sft / "checkpoint" / f"step-{SFT_STEPS}")]
    run_train(args, timeout=600)
    sft_accuracy = scalars(sft / "tb", "eval/exact_match")
    accuracy = scalars(grpo / "tb", "eval/exact_match")
    assert sorted(accuracy) == [0, GRPO_STEPS]
    assert accuracy[0] == sft_accuracy[SFT_STEPS]  # (the GRPO job starts from the SFT job's weights)
    losses, rewards = scalars(grpo / "tb"), scalars(grpo / "tb", "grpo/reward")
    assert sorted(losses) == list(range(1, GRPO_STEPS + 1))
    assert all(math.isfinite(v) for v in [*losses.values(), *rewards.values()])
