"""The main job as a user runs it: the debug config trains, the loss falls, outputs are written.

The run is tests/e2e/chain.py's pretraining (the first link of the chain the SFT, DPO and GRPO tests start from, made
once per session): train_configs/debug_model.toml for PRETRAIN_STEPS steps with checkpoints every PRETRAIN_INTERVAL
steps, so that the last one is off the interval."""

from __future__ import annotations

import re
from pathlib import Path

from tests.e2e.chain import PRETRAIN_INTERVAL, PRETRAIN_STEPS, pretrained
from tests.helpers import scalars


def test_debug_model_trains_and_writes_outputs(pretrained_folder: Path) -> None:
    out = pretrained(pretrained_folder).parents[1]
    losses = scalars(out / "tb")
    assert sorted(losses) == [1, 10, 20, 30, 40]
    assert losses[PRETRAIN_STEPS] < losses[1] - 2.0, losses  # measured: 8.16 -> 5.13
    for step in (PRETRAIN_INTERVAL, PRETRAIN_STEPS):
        assert (out / "checkpoint" / f"step-{step}" / ".metadata").is_file()
    assert not list((out / "checkpoint").glob(".*partial"))
    assert "[training]" in (out / "config.toml").read_text()
    log = (out / "stderr.log").read_text()
    for word in ("loss", "grad_norm", "lr", "tok/s", "mem", "eta"):
        assert word in log
    assert re.search(r"compute dtype (bfloat16|float32) \(auto: this CPU has (no )?native bf16", log)  # (start-up)
