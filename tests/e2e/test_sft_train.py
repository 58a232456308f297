"""SFT end to end on CPU: the debug model, briefly pretrained, learns the bundled tasks.

The run is train_configs/debug_sft.toml as shipped (packing, prompt masking, llama3 template) for 120 steps instead
of 200, starting from a 40-step pretraining run instead of the 100-step default job: tests/e2e/chain.py's
``fine_tuned``, the run DPO's and GRPO's end-to-end tests start from (made once per session). Held-out exact match
(128 samples of assets/tasks/arithmetic/test.jsonl, greedy) is logged before the first step and at the end.
Measured on the 2-core CPU machine: 0.0% before, 35.9% after 120 steps (52.3% after 200). The threshold (20%)
leaves room for other machines' float rounding; the full debug_sft.toml run from the 100-step default job reaches
81.2% (docs/post_training.md).
"""

from __future__ import annotations

from pathlib import Path

from tests.e2e.chain import SFT_STEPS, fine_tuned
from tests.helpers import scalars


def test_debug_sft_raises_heldout_exact_match(pretrained_folder: Path) -> None:
    sft = fine_tuned(pretrained_folder).parents[1]
    accuracy = scalars(sft / "tb", "eval/exact_match")
    assert sorted(accuracy) == [0, SFT_STEPS]
    before, after = accuracy[0], accuracy[SFT_STEPS]
    print(f"held-out exact match: {before:.3f} before, {after:.3f} after {SFT_STEPS} SFT steps")
    assert before <= 0.05, before
    assert after >= 0.2, (before, after)  # measured 0.359
    assert "eval step 0: exact match" in (sft / "stderr.log").read_text()
