"""The bundled image-text task (train_configs/debug_vlm_sft.toml: a tiny Gemma 3 made of files in assets/, weights
from the seed, learning the colour or shape of Pillow-drawn pictures) as a newcomer runs it, kept short: 40 steps
instead of 300 and 12 held-out rows instead of 48. The loss falls, and held-out exact match, whose prompts carry
their images through generation, is measured before the first step and after the last (measured on the 2-core CPU
machine: loss 3.33 -> 0.69, exact match 0% -> 50.0%; the full run's numbers are in docs/vision.md)."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import REPO, run_train, scalars

STEPS = 40


def test_debug_vlm_sft_learns_and_measures_exact_match(tmp_path: Path) -> None:
    args = ["--job.config_file", str(REPO / "train_configs/debug_vlm_sft.toml"), "--job.dump_folder", str(tmp_path)]
    args += ["--job.no_print_config", "--training.steps", str(STEPS), "--metrics.log_freq", "1"]
    args += ["--eval.interval", str(STEPS), "--eval.max_samples", "12"]
    result = run_train(args, timeout=600)
    losses = scalars(tmp_path / "tb")
    assert losses[STEPS] < 0.4 * losses[1], (losses[1], losses[STEPS])
    accuracy = scalars(tmp_path / "tb", "eval/exact_match")
    assert sorted(accuracy) == [0, STEPS]
    assert all(0.0 <= value <= 1.0 for value in accuracy.values())
    assert "eval step 0: exact match" in result.stderr and f"eval step {STEPS}: exact match" in result.stderr
