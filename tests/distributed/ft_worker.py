"""One replica group of test_fault_tolerance.py: titanium.train's job, then this rank's final weights.

Run under torchrun with titanium.train's arguments; the weights (full tensors, by name) go to the file named by
FT_WEIGHTS_OUT, so the test can compare the groups bit for bit, and rank 0's process id to FT_WEIGHTS_OUT + ".pid"
(torchrun starts its workers in their own session: the test kills the worker itself, as a crash would).

Knobs for the test, read from the environment: FT_DIE_IN_STEP=N makes the group SIGKILL itself in step N,
after its forward and backward and before the cross-group all-reduce (so the survivor's step N fails at a known
point); FT_ALONE_STEP_SECONDS=S makes each step the group runs alone last at least S seconds (sleeping), so a
restarted group has time to rejoin before the survivor finishes, while the steps with both groups run at speed;
FT_START_TOGETHER=PREFIX makes groups that start together wait, once built (their torchft managers heartbeating),
until every group of the job is (files PREFIX.<replica id>): a group that asked for its first quorum while the other
was still importing torch would otherwise train alone (the lighthouse takes one group as a quorum).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from titanium.config import load_config
from titanium.parallel.distributed import shutdown_distributed, wait_for_all_ranks
from titanium.preflight import check_job
from titanium.train import _setup_logging
from titanium.trainer import Trainer


def main() -> None:
    _setup_logging()
    if os.environ["RANK"] == "0":
        Path(os.environ["FT_WEIGHTS_OUT"] + ".pid").write_text(str(os.getpid()))
    cfg = load_config(sys.argv[1:])
    trainer = Trainer(cfg, check_job(cfg, int(os.environ["WORLD_SIZE"])))
    _add_test_knobs(trainer)
    if "FT_START_TOGETHER" in os.environ:
        _start_together(os.environ["FT_START_TOGETHER"], cfg.fault_tolerance)
    trainer.train()
    weights = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in trainer.model.state_dict().items()}
    if trainer.env.rank == 0:
        torch.save(weights, os.environ["FT_WEIGHTS_OUT"])
    wait_for_all_ranks()
    trainer.close()
    shutdown_distributed()


def _start_together(prefix: str, ft) -> None:
    Path(f"{prefix}.{ft.replica_id}").touch()
    deadline = time.monotonic() + 120
    while not all(Path(f"{prefix}.{g}").exists() for g in range(ft.group_size)):
        assert time.monotonic() < deadline, "the other replica groups never started"
        time.sleep(0.05)


def _add_test_knobs(trainer: Trainer) -> None:
    die_in_step = int(os.environ.get("FT_DIE_IN_STEP", 0))
    alone_step_seconds = float(os.environ.get("FT_ALONE_STEP_SECONDS", 0))
    run, train_step = trainer.executor.run, trainer.train_step

    def run_then_maybe_die(*args, **kwargs):
        result = run(*args, **kwargs)
        if trainer.train_state.step + 1 == die_in_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    def paced_train_step():
        start = time.monotonic()
        result = train_step()
        if alone_step_seconds and trainer.fault_tolerance.manager.num_participants() == 1:
            time.sleep(max(0.0, start + alone_step_seconds - time.monotonic()))
        return result

    trainer.executor.run, trainer.train_step = run_then_maybe_die, paced_train_step


if __name__ == "__main__":
    main()
