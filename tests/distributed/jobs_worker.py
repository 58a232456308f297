"""Runs several training jobs one after the other in one launch: ``python -m tests.distributed.jobs_worker
JOBS.json`` (one process) or under torchrun (every rank runs every job). JOBS.json is a list of argument
lists for ``titanium.train``. A test that compares several models across a layout so pays for one torchrun
start instead of one per model.

The jobs share the launch's process group: the first job creates it, the later ones join it, and it is torn
down after the last (a gloo group destroyed and made again in the same processes finds the old one's
addresses in the launcher's store and cannot connect). Each job still builds its own device mesh.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import titanium.train
import titanium.trainer
from titanium.config.sections import CommSection
from titanium.parallel import distributed


def join_or_init(comm: CommSection) -> distributed.DistEnv:
    """The trainer's ``init_distributed``, or the group of an earlier job (CPU: these tests run on gloo)."""
    if not dist.is_initialized():
        return distributed.init_distributed(comm)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    return distributed.DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, torch.device("cpu"))


def run_jobs_file(path: str) -> None:
    """Every job of the JSON list at ``path``, in this launch (a test's wrapper module may patch first)."""
    titanium.trainer.init_distributed = join_or_init
    shutdown = distributed.shutdown_distributed
    distributed.shutdown_distributed = lambda: None  # titanium.train imports it when main() runs
    try:
        for argv in json.loads(Path(path).read_text()):
            code = titanium.train.main(argv)
            if code:
                sys.exit(code)
    finally:
        shutdown()


if __name__ == "__main__":
    run_jobs_file(sys.argv[1])
