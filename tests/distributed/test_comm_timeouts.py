"""Collective timeouts reach every process group, and a hang leaves every rank's Flight Recorder trace.

One 4-rank gloo job (tp 2 x dp_shard 2) runs comm_timeout_worker.py:
- before the first step every mesh group has the start-up timeout, after it the train timeout (torch
  gives groups made after init_process_group its own 30-minute default, which [comm] never reached);
- a rank slower than the train timeout to finish step 1 does not make the others time out (barrier);
- rank 3 skips an all-reduce of its TP group: within the train timeout plus the watchdog's poll every
  rank's trace is on disk, and torch's analyzer names the collective, its group and the missing rank.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO, env

TRAIN_TIMEOUT = 4
WORLD = 4
WATCHDOG_SLACK = 4.0
"""Seconds past the train timeout allowed for the dump: the 1 s store poll plus 4 processes on 2 cores."""


def test_timeouts_reach_every_group_and_a_hang_dumps_every_rank(tmp_path):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0", str(REPO / "tests/distributed/comm_timeout_worker.py"),
        str(tmp_path), str(TRAIN_TIMEOUT),
    ]  # fmt: skip
    job = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=240)
    assert job.returncode != 0, "the hung collective must fail the job"

    mesh_groups = {"default_pg", "mesh_pp", "mesh_dp_replicate", "mesh_dp_shard", "mesh_cp", "mesh_tp", "mesh_dp"}
    for rank in range(WORLD):
        report_file = tmp_path / f"timeouts_rank{rank}.json"
        assert report_file.exists(), f"rank {rank} did not get past the train timeout switch:\n{job.stderr[-3000:]}"
        report = json.loads(report_file.read_text())
        assert report["at_start"] == {g: 60.0 for g in mesh_groups}
        assert report["after_switch"] == {g: float(TRAIN_TIMEOUT) for g in mesh_groups}
        assert report["all_reduce"] == [2.0] * 4

    traces = tmp_path / "comm_traces"
    assert sorted(p.name for p in traces.iterdir()) == [f"rank_{r}" for r in range(WORLD)]
    hang_start = min(float((tmp_path / f"hang_starts_rank{r}").read_text()) for r in range(3))
    for trace in traces.iterdir():
        assert trace.stat().st_mtime - hang_start < TRAIN_TIMEOUT + WATCHDOG_SLACK, trace.name
    assert f"torchfrtrace {traces} -p rank_" in job.stderr  # the failing rank says how to read them

    analysis = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(traces), "-p", "rank_"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    blocks = (analysis.stdout + analysis.stderr).split("Not all ranks joining collective")
    tp_block = next(b for b in blocks if "mesh_tp" in b)
    assert "collective: gloo:all_reduce" in tp_block
    assert "missing ranks: {3}" in tp_block and "expected ranks: {2, 3}" in tp_block
    assert "comm_timeout_worker.py:" in tp_block  # the Python stack of the collective that hung
