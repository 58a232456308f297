"""Resuming into a folder whose run was configured otherwise names the keys that change its results."""

from __future__ import annotations

import logging

from tests.helpers import tiny_args
from titanium.config import load_config, to_toml_dict
from titanium.config.resumed import changed_keys
from titanium.parallel.distributed import shutdown_distributed


def test_only_keys_that_change_results_are_named():
    saved = to_toml_dict(load_config([]))
    current = to_toml_dict(
        load_config(
            ["--optimizer.lr", "0.5", "--model.flavor", "1B", "--training.steps", "7", "--metrics.log_freq", "3"]
            + ["--checkpoint.interval", "9", "--parallelism.tensor_parallel_degree", "2"]
        )
    )
    assert changed_keys(saved, current) == ["model.flavor 'debugmodel' -> '1B'", "optimizer.lr 0.0008 -> 0.5"]
    assert changed_keys(saved, {**current, "optimizer": {"brand_new_key": 1}}) == ["model.flavor 'debugmodel' -> '1B'"]


def test_resuming_with_another_config_warns_naming_the_keys(make_trainer, tmp_path, caplog):
    """It used to resume silently (past the last step: only "nothing to do")."""
    common = ("--data.kind", "synthetic", "--checkpoint.enable", "--checkpoint.interval", "1")
    make_trainer(*tiny_args(tmp_path, *common, "--training.steps", "1")).train()
    shutdown_distributed()
    with caplog.at_level(logging.WARNING, logger="titanium"):
        make_trainer(*tiny_args(tmp_path, *common, "--training.steps", "2", "--metrics.log_freq", "2"))
    assert not [r for r in caplog.records if "resuming the run" in r.getMessage()]  # (steps and logging only)
    shutdown_distributed()
    with caplog.at_level(logging.WARNING, logger="titanium"):
        make_trainer(*tiny_args(tmp_path, *common, "--training.steps", "1", "--optimizer.lr", "0.01"))
    warnings = [r.getMessage() for r in caplog.records if "resuming the run" in r.getMessage()]
    assert len(warnings) == 1 and "in keys that change its results: optimizer.lr 0.003 -> 0.01." in warnings[0]
