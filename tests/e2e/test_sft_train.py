"""SFT end to end on CPU: the debug model, briefly pretrained, learns the bundled tasks.

The run is train_configs/debug_sft.toml as shipped (200 steps, packing, prompt masking, llama3 template),
starting from a 40-step pretraining run instead of the 100-step default job. Held-out exact match (128 samples of
assets/tasks/arithmetic/test.jsonl, greedy) is logged before the first step and at the end.
Measured on the 2-core CPU machine: 0.0% before, 52.3% after 200 steps (the test takes about 4 minutes).
The threshold (30%) leaves room for other machines' float rounding; the full debug_sft.toml run from the
100-step default job reaches 81.2% (docs/post_training.md).
"""

from __future__ import annotations

from pathlib import Path

from tests.e2e.chain import pretrained
from tests.helpers import REPO, run_train, scalars

SFT_STEPS = 200


def test_debug_sft_raises_heldout_exact_match(tmp_path: Path, pretrained_folder: Path) -> None:
    sft = tmp_path / "sft"
    result = run_train([
        "--job.config_file", str(REPO / "train_configs/debug_sft.toml"),
        "--job.dump_folder", str(sft),
        "--job.no_print_config",
        "--checkpoint.initial_load_path", str(pretrained(pretrained_folder)),
        "--training.steps", str(SFT_STEPS),
        "--eval.interval", str(SFT_STEPS),
    ], timeout=600)  # fmt: skip
    accuracy = scalars(sft / "tb", "eval/exact_match")
    assert sorted(accuracy) == [0, SFT_STEPS]
    before, after = accuracy[0], accuracy[SFT_STEPS]
    print(f"held-out exact match: {before:.3f} before, {after:.3f} after {SFT_STEPS} SFT steps")
    assert before <= 0.05, before
    assert after >= 0.3, (before, after)  # measured 0.523
    assert "eval step 0: exact match" in result.stderr
