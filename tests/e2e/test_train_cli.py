"""The main job as a user runs it: the debug config trains, the loss falls, outputs are written."""

from __future__ import annotations

import re

from tests.helpers import REPO, run_train, scalars


def test_debug_model_trains_and_writes_outputs(tmp_path):
    out = tmp_path / "run"
    result = run_train(
        [
            "--job.config_file", str(REPO / "train_configs/debug_model.toml"),
            "--job.dump_folder", str(out),
            "--training.steps", "30",
            "--checkpoint.interval", "20",
        ]
    )  # fmt: skip
    losses = scalars(out / "tb")
    assert sorted(losses) == [1, 10, 20, 30]
    assert losses[30] < losses[1] - 2.0, losses  # measured: 8.24 -> ~5.4
    for step in (20, 30):
        assert (out / "checkpoint" / f"step-{step}" / ".metadata").is_file()
    assert not list((out / "checkpoint").glob(".*partial"))
    assert "[training]" in (out / "config.toml").read_text()
    log = result.stderr
    for word in ("loss", "grad_norm", "lr", "tok/s", "mem", "eta"):
        assert word in log
    assert re.search(r"compute dtype (bfloat16|float32) \(auto: this CPU has (no )?native bf16", log)  # (start-up)
