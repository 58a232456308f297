"""Several titanium.train jobs in one launch, with probes for the MoE layout tests.

Run as ``python -m tests.distributed.moe_worker JOB [--then JOB ...]`` (under torchrun for several processes), each
JOB being titanium.train's arguments. The jobs share the process group (a torchrun start costs ~10 s on the CI's
2 cores) and run one after the other. Each writes under its ``--job.dump_folder``/probe:

- ``loads_rank{r}.json``: per step, per MoE layer this rank holds, the tokens routed to each expert summed over
  all ranks (what the bias update and the load metrics see);
- ``grads_step{s}_rank{r}.pt``: the full gradient of every parameter this rank holds, before clipping, at the
  first and the last step (written by one rank per pipeline stage).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import titanium.trainer as trainer_module
from titanium.config import load_config
from titanium.moe_balance import LoadBalancer
from titanium.parallel.distributed import init_distributed, shutdown_distributed, wait_for_all_ranks
from titanium.parallel.params import clean_fqn
from titanium.preflight import check_job
from titanium.train import _setup_logging
from titanium.trainer import Trainer


def _jobs(argv: list[str]) -> list[list[str]]:
    jobs: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--then":
            jobs.append([])
        else:
            jobs[-1].append(arg)
    return jobs


def _probe(trainer: Trainer) -> None:
    folder = Path(trainer.cfg.job.dump_folder) / "probe"
    folder.mkdir(parents=True, exist_ok=True)
    rank, last = trainer.env.rank, trainer.cfg.training.steps
    loads: dict[int, dict[int, list[float]]] = {}
    clip = trainer._clip_grad_norm
    balancer_step = LoadBalancer.after_optimizer_step  # (the loop calls it through its hook, never by name)

    def after_optimizer_step(balancer: LoadBalancer) -> None:
        balancer_step(balancer)
        if balancer._loads is not None:
            step = trainer.train_state.step + 1
            loads[step] = {layer: row for layer, row in zip(balancer.layers, balancer._loads.tolist())}
            (folder / f"loads_rank{rank}.json").write_text(json.dumps(loads))

    def clip_grad_norm() -> torch.Tensor:
        step = trainer.train_state.step + 1
        if step in (1, last):
            grads = {}
            for name, p in trainer.model.named_parameters():
                if p.grad is not None:
                    grads[clean_fqn(name)] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
            meshes = trainer.meshes
            if all(m.get_local_rank() == 0 for m in (meshes.dp, meshes.tp, meshes.cp)):
                torch.save(grads, folder / f"grads_step{step}_rank{rank}.pt")
        return clip()

    LoadBalancer.after_optimizer_step = after_optimizer_step  # type: ignore[method-assign]
    trainer._clip_grad_norm = clip_grad_norm


def main() -> None:
    _setup_logging()
    world = int(os.environ.get("WORLD_SIZE", 1))
    env = None

    def shared_process_group(comm):  # every job joins the group the first one made
        nonlocal env
        if env is None:
            env = init_distributed(comm)
        return env

    trainer_module.init_distributed = shared_process_group
    for argv in _jobs(sys.argv[1:]):
        cfg = load_config(argv)
        trainer = Trainer(cfg, check_job(cfg, world))
        balancer_step = LoadBalancer.after_optimizer_step
        _probe(trainer)
        trainer.train()
        trainer.close()
        LoadBalancer.after_optimizer_step = balancer_step  # type: ignore[method-assign]
        if dist.is_initialized() and world > 1:
            dist.barrier()
    wait_for_all_ranks()
    shutdown_distributed()


if __name__ == "__main__":
    main()
