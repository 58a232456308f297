"""Worker of test_comm_timeouts.py (4 ranks under torchrun): timeouts of every group, then a hang.

Phase 1: the start-up timeout reaches every group of the mesh; rank 1 is slow to finish its "first
step", and a collective right after the switch to the train timeout must still succeed (the switch
waits at a barrier); then every group has the train timeout. Each rank writes what it saw to
<dump>/timeouts_rank<N>.json.
Phase 2: rank 3 skips an all-reduce of its TP group; rank 2 waits in it until the train timeout
fires, and Flight Recorder must get every rank's trace written before the job dies.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

from titanium.config import load_config
from titanium.debug.flight_recorder import FlightRecorder
from titanium.parallel.dims import ParallelDims
from titanium.parallel.distributed import init_distributed, set_collective_timeout, set_train_timeout

SLOW_RANK, SKIPPING_RANK = 1, 3


def group_timeouts() -> dict[str, float]:
    """Collective timeout (seconds) of every process group this rank is in, by its description."""
    return {
        group.group_desc: group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        for group in _world.pg_map
    }


def main(dump_folder: str, train_timeout: int) -> None:
    Path(dump_folder).mkdir(parents=True, exist_ok=True)
    cfg = load_config(
        [
            "--job.dump_folder", dump_folder,
            "--parallelism.tensor_parallel_degree", "2",
            "--comm.init_timeout_seconds", "60",
            "--comm.train_timeout_seconds", str(train_timeout),
        ]
    )  # fmt: skip
    with FlightRecorder(cfg.comm, cfg.job.dump_folder):
        env = init_distributed(cfg.comm)
        dims = ParallelDims.from_config(cfg.parallelism, env.world_size)
        meshes = dims.build_meshes("cpu")
        set_collective_timeout(cfg.comm.init_timeout_seconds)
        at_start = group_timeouts()
        if env.rank == SLOW_RANK:
            time.sleep(train_timeout + 1)  # a first step slower than the train timeout
        set_train_timeout(cfg.comm)
        x = torch.ones(4)
        dist.all_reduce(x, group=meshes.dp.get_group())  # right after the switch: must not time out
        report = {"at_start": at_start, "after_switch": group_timeouts(), "all_reduce": x.tolist()}
        Path(dump_folder, f"timeouts_rank{env.rank}.json").write_text(json.dumps(report))

        tp = meshes.tp.get_group()
        dist.all_reduce(x, group=tp)
        if env.rank != SKIPPING_RANK:
            Path(dump_folder, f"hang_starts_rank{env.rank}").write_text(str(time.time()))
            dist.all_reduce(x, group=tp)  # rank 2 waits here for rank 3
        dist.all_reduce(x)  # everyone else goes on to the next collective and waits there


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
