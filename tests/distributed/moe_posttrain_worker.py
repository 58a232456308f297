"""``tests.distributed.moe_worker`` (several jobs in one launch, probes of routed tokens and gradients) for the MoE
post-training tests: GRPO samples the responses fixed in advance (tests/objectives/fixed_rollouts.py), and every
rank writes what its rollout engine holds after syncs: ``engine_v{version}_rank{r}.pt`` under the job's
``--job.dump_folder``/probe, the engine's whole state dict, at the last step's version on every rank and at
version 0 (the weights before training) on rank 0.

Run as ``python -m tests.distributed.moe_posttrain_worker JOB [--then JOB ...]`` (under torchrun for several
processes).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.distributed import moe_worker
from tests.objectives.fixed_rollouts import fixed_sample
from titanium.config import JobConfig
from titanium.generation.titanium_engine import TitaniumEngine
from titanium.rl.source import RolloutSource

_load_config, _finish_sync = moe_worker.load_config, TitaniumEngine.finish_sync
_job: dict[str, JobConfig] = {}
"""The job that runs now (its engine syncs first while its trainer is being built)."""


def load_config(argv: list[str]) -> JobConfig:
    _job["cfg"] = cfg = _load_config(argv)
    return cfg


def finish_sync(engine: TitaniumEngine, version: int) -> None:
    _finish_sync(engine, version)
    cfg, rank = _job["cfg"], int(os.environ.get("RANK", 0))
    if version == cfg.training.steps or (version == 0 and rank == 0):
        folder = Path(cfg.job.dump_folder) / "probe"
        folder.mkdir(parents=True, exist_ok=True)
        weights = {name: value.detach().clone() for name, value in engine.weights.items()}
        torch.save(weights, folder / f"engine_v{version}_rank{rank}.pt")


if __name__ == "__main__":
    RolloutSource.sample = fixed_sample  # type: ignore[method-assign]
    TitaniumEngine.finish_sync = finish_sync  # type: ignore[method-assign]
    moe_worker.load_config = load_config
    moe_worker.main()
