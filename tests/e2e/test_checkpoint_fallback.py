"""A damaged newest checkpoint: resume from the previous complete one with a warning, never crash.

One run saves step-2 and step-4 (deterministic, one process). A copy of it with a truncated data file
or a corrupted .metadata in step-4 resumes from step-2 and repeats steps 3-4 with exactly the losses of
the original run; with both checkpoints damaged the run stops with exit code 2 naming them.
"""

from __future__ import annotations

import logging
import shutil

import pytest

from tests.helpers import run_train, scalars, tiny_args
from titanium.train import main

ARGS = ("--data.kind", "synthetic", "--debug.deterministic", "--checkpoint.enable", "--checkpoint.interval", "2")


def args(out, *extra):
    return tiny_args(out, *ARGS, "--training.steps", "4", *extra)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("saved") / "run"
    run_train(args(out))
    return out, scalars(out / "tb")


def truncate_data(step_dir):
    data = next(step_dir.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:1000])
    return f"{data.name} is truncated (1,000 bytes"


def corrupt_metadata(step_dir):
    metadata = step_dir / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:500])
    return ".metadata cannot be read ("


@pytest.mark.parametrize("damage", [truncate_data, corrupt_metadata])
def test_damaged_newest_checkpoint_falls_back(tmp_path, saved_run, caplog, damage):
    source, expected = saved_run
    out = tmp_path / "run"
    shutil.copytree(source, out)
    problem = damage(out / "checkpoint/step-4")
    with caplog.at_level(logging.INFO, logger="titanium"):
        assert main([*args(out), "--metrics.save_tb_folder", "tb_resumed"]) == 0
    log = caplog.text
    assert f"skipping checkpoint {out / 'checkpoint/step-4'}: {problem}" in log
    assert "resuming at step 2" in log
    resumed = scalars(out / "tb_resumed")
    assert resumed == {3: expected[3], 4: expected[4]}  # bitwise: --debug.deterministic, one process
    assert (out / "checkpoint/step-4/.metadata").is_file()  # re-saved over the damaged one


def test_no_usable_checkpoint_stops_with_exit_2(tmp_path, saved_run, capsys):
    source, _ = saved_run
    out = tmp_path / "run"
    shutil.copytree(source, out)
    truncate_data(out / "checkpoint/step-4")
    corrupt_metadata(out / "checkpoint/step-2")
    assert main(args(out)) == 2
    err = capsys.readouterr().err
    assert err.startswith("titanium: error: no usable checkpoint to resume from (") and "Traceback" not in err
    assert f"{out / 'checkpoint/step-4'}: __0_0.distcp is truncated" in err
    assert f"{out / 'checkpoint/step-2'}: .metadata cannot be read" in err
    assert f"move the broken folders out of {out / 'checkpoint'}" in err


def test_initial_load_path_applies_with_checkpointing_off(tmp_path, saved_run, caplog):
    """--checkpoint.initial_load_path used to be ignored without --checkpoint.enable."""
    source, expected = saved_run
    step2 = source / "checkpoint/step-2"
    out = tmp_path / "run"
    extra = ("--data.kind", "synthetic", "--training.steps", "1", "--checkpoint.initial_load_path", str(step2))
    with caplog.at_level(logging.INFO, logger="titanium"):
        assert main(tiny_args(out, *extra)) == 0
    assert f"loaded model from {step2}" in caplog.text
    assert scalars(out / "tb")[1] != pytest.approx(expected[1], rel=1e-6)  # not the fresh weights' loss
    assert not (out / "checkpoint").exists()
