"""KTO end to end on CPU: train_configs/debug_kto.toml as shipped, from a fresh debug model, on the first 16 rows
of the bundled unpaired data (4 desirable, 12 undesirable; scripts/make_unpaired_data.py), seen every step.

The loss must fall and the implicit reward of the desirable completions (beta x log-ratio, 0 at the first step:
the policy is the reference) must end above 0 while the undesirable ones' falls below it. Measured on the 2-core
CPU machine: loss 0.500 -> 0.185 over 10 steps; desirable reward 0 -> -1.08 (step 5, both kinds pushed down
while the undesirable ones fall faster) -> +0.31; undesirable 0 -> -2.57; about 75 s wall. The loss itself is
checked against TRL's KTOTrainer in tests/unit/test_kto_objective.py.

Bad jobs end with one message and exit code 2 before any process group exists.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import LOSS_TAG, REPO, run_train, scalars, tiny_args
from titanium.train import main

STEPS = 10
ROWS = 16


def test_debug_kto_lowers_its_loss_and_raises_the_desirable_rewards(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    lines = (REPO / "assets/tasks/arithmetic/unpaired_train.jsonl").read_text().splitlines(keepends=True)
    rows.write_text("".join(lines[:ROWS]))
    assert sum(json.loads(line)["label"] for line in lines[:ROWS]) == 4  # both kinds in every step
    run_train([
        "--job.config_file", str(REPO / "train_configs/debug_kto.toml"), "--job.dump_folder", str(tmp_path / "run"),
        "--data.path", str(rows), "--checkpoint.no_enable", "--checkpoint.initial_load_path", "",
        "--eval.interval", "0", "--training.steps", str(STEPS), "--metrics.log_freq", "1",
        "--optimizer.lr", "1e-3", "--lr_scheduler.warmup_steps", "2", "--job.no_print_config",
    ])  # fmt: skip
    tb = tmp_path / "run/tb"
    loss, chosen, rejected = (scalars(tb, tag) for tag in (LOSS_TAG, "kto/reward_chosen", "kto/reward_rejected"))
    print(json.dumps({"loss": loss, "reward_chosen": chosen, "reward_rejected": rejected}))
    assert loss[1] == pytest.approx(0.5, abs=1e-6) and chosen[1] == pytest.approx(0.0, abs=1e-6)
    assert loss[STEPS] < 0.6 * loss[1], loss  # measured 0.185 / 0.5
    assert all(loss[s + 1] < loss[s] for s in range(1, STEPS)), loss  # measured: falls every step
    assert chosen[STEPS] > 0.1, chosen  # measured 0.31
    assert chosen[STEPS] > min(chosen.values()) + 1.0, chosen  # rising since its low (-1.08 at step 5)
    assert rejected[STEPS] < -1.0, rejected  # measured -2.57


KTO_MISTAKES = [
    (
        ("--data.kind", "preference", "--data.path", str(REPO / "assets/tasks/arithmetic/preference_test.jsonl")),
        "--training.objective kto needs completions labelled true/false: --data.kind unpaired",
    ),
    (
        ("--training.local_batch_size", "1"),
        "--training.local_batch_size 1: --kto.loss_type kto estimates its KL term from each example's prompt with "
        "another example's completion in the microbatch, so it needs at least 2",
    ),
]


@pytest.mark.parametrize("args, message", KTO_MISTAKES)
def test_kto_config_mistakes_exit_2_with_one_message(tmp_path, capsys, no_process_group, args, message):
    kto = ("--training.objective", "kto", "--data.kind", "unpaired", "--data.path", str(tmp_path / "none.jsonl"))
    (tmp_path / "none.jsonl").write_text("")
    assert main(tiny_args(tmp_path, *kto, *args)) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("titanium: config error: "), err
