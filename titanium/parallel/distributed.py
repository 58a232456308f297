"""Start the process group (torchrun or a plain single process) and pick the device."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _rank_not_in_group, _set_pg_timeout, _world

from titanium.config.sections import CommSection


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def init_distributed(comm: CommSection) -> DistEnv:
    """Join the job's process group: NCCL on GPUs (plus gloo for CPU tensors), gloo on CPU.

    Without torchrun's environment (plain `python -m titanium.train`) this makes a one-process
    group, so the rest of the code never needs a "not distributed" branch.
    """
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    timeout = timedelta(seconds=comm.init_timeout_seconds)
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def set_collective_timeout(seconds: int) -> None:
    """Give every process group this rank belongs to (the default group, each DeviceMesh dim and
    flattened view, the checkpoint group, ...) this collective timeout.

    Groups made after init_process_group do not inherit its timeout: torch gives them its own default
    (30 min on gloo, 10 min on NCCL), so a hang inside FSDP, TP, PP or the loss all-reduce would
    otherwise wait that long whatever [comm] says.
    """
    timeout = timedelta(seconds=seconds)
    for group in list(_world.pg_map):
        if not _rank_not_in_group(group):
            _set_pg_timeout(timeout, group)


def set_train_timeout(comm: CommSection) -> None:
    """After the first step, shorten the collective timeout of every group so a hang fails fast.

    The barrier (still under the long start-up timeout) makes sure no rank runs a collective under the
    short timeout while a slower rank is still finishing its first step.
    """
    if dist.get_world_size() > 1:
        dist.barrier()
    set_collective_timeout(comm.train_timeout_seconds)


def wait_for_all_ranks() -> None:
    """Barrier at the end of a successful run: no rank tears its process groups down while another
    still has collectives in flight (on gloo that can abort a process at exit)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
