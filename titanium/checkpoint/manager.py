"""Save and resume the training state with DCP, one folder per step, never a half-written one.

A save goes to `.step-N.partial/` and is renamed to `step-N/` by rank 0 only after every rank has
finished writing, so a folder named `step-N` is always complete: a run killed mid-save resumes from
the previous one. Older checkpoints are removed only after a newer one is complete.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from titanium.config.sections import CheckpointSection
from titanium.errors import UserError

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be loaded; the message names the folder and the cause."""


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor values with weights_only=False; we never do."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class CheckpointManager:
    def __init__(self, cfg: CheckpointSection, dump_folder: str, states: dict[str, Any], rank: int) -> None:
        """`states` maps top-level keys to Stateful objects; per-rank ones need per-rank keys."""
        self.cfg, self.states, self.rank = cfg, states, rank
        self.folder = Path(dump_folder) / cfg.folder

    def complete_steps(self) -> list[int]:
        if not self.folder.is_dir():
            return []
        steps = []
        for path in self.folder.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and (path / ".metadata").is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def should_save(self, step: int, last_step: int) -> bool:
        return self.cfg.enable and (step % self.cfg.interval == 0 or step == last_step)

    def load(self) -> int:
        """Restore the newest (or `load_step`) checkpoint; returns its step, 0 when starting fresh."""
        if not self.cfg.enable:
            return 0
        steps = self.complete_steps()
        if self.cfg.load_step != -1:
            if self.cfg.load_step not in steps:
                raise CheckpointError(
                    f"--checkpoint.load_step {self.cfg.load_step}: no complete checkpoint "
                    f"{self.folder}/step-{self.cfg.load_step} (available: {steps or 'none'})"
                )
            step = self.cfg.load_step
        elif steps:
            step = steps[-1]
        else:
            return 0
        path = self.folder / f"step-{step}"
        start = time.perf_counter()
        try:
            dcp.load(self.states, checkpoint_id=str(path), planner=SafeLoadPlanner())
        except Exception as e:  # DCP wraps per-rank failures in CheckpointException
            raise CheckpointError(f"cannot load checkpoint {path}: {e}") from e
        logger.info("resumed from %s in %.2fs", path, time.perf_counter() - start)
        return step

    def save(self, step: int) -> None:
        final = self.folder / f"step-{step}"
        partial = self.folder / f".step-{step}.partial"
        start = time.perf_counter()
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        dist.barrier()
        dcp.save(self.states, checkpoint_id=str(partial))
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            partial.rename(final)
            self._purge_old(keep=step)
        dist.barrier()
        logger.info("saved checkpoint %s in %.2fs", final, time.perf_counter() - start)

    def _purge_old(self, keep: int) -> None:
        if self.cfg.keep_latest_k <= 0:
            return
        steps = self.complete_steps()
        for old in steps[: -self.cfg.keep_latest_k]:
            if old != keep:
                shutil.rmtree(self.folder / f"step-{old}", ignore_errors=True)
