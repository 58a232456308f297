"""DPO end to end on CPU: the debug model, briefly pretrained and fine-tuned, learns the bundled preferences.

The chain of the quick start, shortened: debug_model.toml for 40 steps, debug_sft.toml for 120 steps, then
train_configs/debug_dpo.toml as shipped (beta 0.1, rpo_alpha 1.0, 16 pairs per step) for 60 steps from the
SFT checkpoint, which is the frozen reference. Then titanium.tools.eval_preference scores the first 200
held-out pairs (assets/tasks/arithmetic/preference_test.jsonl) with the DPO policy against the reference:

- reward accuracy (the implicit reward beta x log-ratio higher for the chosen answer) and mean margin: both
  are 0 before DPO (the policy is the reference), and must rise clearly;
- held-out exact match of greedy answers (128 rows of test.jsonl, logged by the DPO run at steps 0 and 60)
  must not collapse.

`measure(folder, seed, *chain.start("dpo", folder, seed))` is the whole chain. Measured on the 2-core CPU machine
for seeds 0, 1, 2: reward accuracy 0.845 / 0.79 / 0.82, margin 0.223 / 0.228 / 0.236, exact match
40.6% -> 51.6%, 36.7% -> 39.1%, 36.7% -> 35.9% (docs/post_training.md); 175-190 s of CPU time (one thread),
4-13 minutes of wall time depending on the machine's other load. In a test session the DPO run goes side by side
with the GRPO test's run (tests/e2e/conftest.py's ``post_trained``). The thresholds leave room for other machines'
float rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.chain import DPO_STEPS, dpo_config
from tests.helpers import REPO, Background, run_train, scalars
from titanium.tools import eval_preference

HELD_OUT_PAIRS = 200


def measure(folder: Path, seed: int, dpo: Path, run: Background) -> dict[str, float]:
    """Held-out preference metrics of the chain's DPO ``run`` of ``seed`` (in ``dpo``, from
    ``fine_tuned(folder, seed)``) and its exact match before/after DPO, once the run has ended."""
    run.wait()
    exact_match = scalars(dpo / "tb", "eval/exact_match")
    config = dpo_config(folder, seed)
    args = eval_preference.parser().parse_args([
        str(dpo / f"checkpoint/step-{DPO_STEPS}"), config[-1], "--max-pairs", str(HELD_OUT_PAIRS),
        "--data", str(REPO / "assets/tasks/arithmetic/preference_test.jsonl"),
    ])  # fmt: skip
    held_out = eval_preference.run(args, config)
    return {**held_out, "exact_match_before": exact_match[0], "exact_match_after": exact_match[DPO_STEPS]}


def test_debug_dpo_raises_heldout_preference_accuracy_and_keeps_exact_match(
    pretrained_folder: Path, post_trained: dict[str, tuple[Path, Background]]
) -> None:
    result = measure(pretrained_folder, 0, *post_trained["dpo"])
    print(json.dumps(result))
    assert result["pairs"] == HELD_OUT_PAIRS
    assert result["reward_accuracy"] >= 0.7, result  # 0 before DPO; measured 0.79-0.845
    assert result["margin"] >= 0.15, result  # 0 before DPO; measured 0.22-0.24
    assert result["exact_match_after"] >= result["exact_match_before"] - 0.1, result  # measured -0.8 to +11 points


SIMPO_STEPS = 12


def test_simpo_lowers_its_loss_without_a_reference(tmp_path: Path) -> None:
    """SimPO (reference-free) from a fresh debug model on 16 pairs seen every step: the loss must fall. Short on
    purpose (the chain above already takes minutes); the loss itself is checked against TRL's function in
    tests/unit/test_dpo_objective.py."""
    pairs = tmp_path / "pairs.jsonl"
    lines = (REPO / "assets/tasks/arithmetic/preference_train.jsonl").read_text().splitlines(keepends=True)
    pairs.write_text("".join(lines[:16]))
    run_train([
        "--job.config_file", str(REPO / "train_configs/debug_dpo.toml"), "--job.dump_folder", str(tmp_path / "run"),
        "--data.path", str(pairs), "--checkpoint.no_enable", "--checkpoint.initial_load_path", "",
        "--eval.interval", "0", "--dpo.loss_type", "simpo", "--dpo.rpo_alpha", "0", "--dpo.beta", "2.0",
        "--dpo.simpo_gamma", "1.0", "--training.steps", str(SIMPO_STEPS), "--metrics.log_freq", "1",
        "--optimizer.lr", "1e-3", "--lr_scheduler.warmup_steps", "2", "--job.no_print_config",
    ])  # fmt: skip
    loss = scalars(tmp_path / "run/tb")
    first, last = loss[1], loss[SIMPO_STEPS]
    print(json.dumps({"first": first, "last": last}))
    assert last < 0.7 * first, loss
