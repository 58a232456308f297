"""A run stopped by a NaN step, as a user sees it: one message naming the step, exit code 2, and on disk only the
checkpoints of steps before it, the asynchronous one in flight finished and published (no partial folder)."""

from __future__ import annotations

import subprocess

from tests.helpers import REPO, env, tiny_args, train_cmd
from titanium.checkpoint.manager import complete_steps


def test_nan_stop_exits_2_naming_the_step_with_clean_checkpoints(tmp_path):
    args = tiny_args(
        tmp_path, "--data.kind", "synthetic", "--training.objective", "tests.objectives.faults:NanLoss",
        "--training.steps", "8", "--metrics.log_freq", "10",
        "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.async_mode", "async",
    )  # fmt: skip
    result = subprocess.run(train_cmd(args), cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "titanium: stopped: step 3: the loss is nan and the gradient norm" in result.stderr
    assert "Stopped at step 4" in result.stderr and "Traceback" not in result.stderr
    checkpoints = tmp_path / "checkpoint"
    assert complete_steps(checkpoints) == [2]  # saved asynchronously at step 2, finished while stopping
    assert not list(checkpoints.glob(".*partial"))
