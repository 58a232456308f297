"""Profiling: torch.profiler traces of a few steps every N steps, and CUDA memory snapshots.

Built from the [profiling] section; the loop calls ``start()`` before its first step, ``step(step)``
after each step and ``stop()`` at the end (or uses it as a context manager). Each rank writes its own
files under job.dump_folder:

    profile_traces/iteration_<step>/rank<N>_trace.json              (Perfetto, chrome://tracing)
    memory_snapshot/iteration_<step>/rank<N>_memory_snapshot.pickle  (https://pytorch.org/memory_viz)
    memory_snapshot/oom_rank<N>_memory_snapshot.pickle               (written when CUDA runs out of memory)

A trace of step N holds the marker ``ProfilerStep#N``: profiler steps are numbered like training steps.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from titanium.config.sections import ProfilingSection

logger = logging.getLogger(__name__)

MEMORY_HISTORY_ENTRIES = 100_000
"""Allocation events kept for a snapshot (each costs a few KB of host memory)."""


class Profiler:
    """Traces steps N, 2N, ... (each after ``profiler_warmup`` unrecorded steps) and snapshots memory."""

    def __init__(self, cfg: ProfilingSection, dump_folder: str | Path, rank: int, start_step: int = 0) -> None:
        """``start_step``: the step the run resumes from (0 for a fresh run)."""
        self.cfg, self.rank = cfg, rank
        self.first_step = start_step + 1
        self.trace_folder = Path(dump_folder) / cfg.save_traces_folder
        self.snapshot_folder = Path(dump_folder) / cfg.save_memory_snapshot_folder
        self.snapshots = cfg.enable_memory_snapshot and torch.cuda.is_available()
        if cfg.enable_memory_snapshot and not self.snapshots and rank == 0:
            logger.warning("profiling.enable_memory_snapshot needs CUDA; no memory snapshots on this CPU run")
        self._finished_step = start_step
        self._stopping = False
        self._torch_profiler: torch.profiler.profile | None = None

    def __enter__(self) -> Profiler:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> Profiler:
        if self.cfg.enable_profiling:
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            prof = torch.profiler.profile(
                activities=activities, schedule=self._action, on_trace_ready=self._write_trace, record_shapes=True
            )
            # Number profiler steps like training steps: park just before the first one (a step with
            # no action), start, and step into it, so its marker reads ProfilerStep#<first step>.
            prof.step_num = self.first_step - 1
            prof.start()
            prof.step()
            self._torch_profiler = prof
        if self.snapshots:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
            torch._C._cuda_attach_out_of_memory_observer(self._on_oom)
        return self

    def step(self, step: int) -> None:
        """Call after training step ``step`` has finished (no device sync unless a snapshot is due)."""
        self._finished_step = step
        if self._torch_profiler is not None:
            self._torch_profiler.step()
        if self.snapshots and step % self.cfg.profile_freq == 0:
            self._write_snapshot(self.snapshot_folder / f"iteration_{step}" / f"rank{self.rank}_memory_snapshot.pickle")

    def stop(self) -> None:
        if self._torch_profiler is not None:
            self._stopping = True
            self._torch_profiler.stop()
            self._torch_profiler = None
        if self.snapshots:
            torch.cuda.memory._record_memory_history(enabled=None)

    def _action(self, step: int) -> ProfilerAction:
        """What the profiler does during training step ``step``: within each window of profile_freq
        steps, the last profiler_active are recorded after profiler_warmup warm-up steps."""
        if step < self.first_step:
            return ProfilerAction.NONE
        freq, active, warmup = self.cfg.profile_freq, self.cfg.profiler_active, self.cfg.profiler_warmup
        position = (step - 1) % freq + 1  # 1 .. freq
        if position == freq:
            return ProfilerAction.RECORD_AND_SAVE
        if position > freq - active:
            return ProfilerAction.RECORD
        if position > freq - active - warmup:
            return ProfilerAction.WARMUP
        return ProfilerAction.NONE

    def _write_trace(self, prof: torch.profiler.profile) -> None:
        if self._stopping and self._action(self._finished_step) != ProfilerAction.RECORD:
            return  # stopped in a window whose only step is the one after the last: it never ran
        folder = self.trace_folder / f"iteration_{self._finished_step}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}_trace.json"
        prof.export_chrome_trace(str(path))
        logger.info("profiler trace of step %d written to %s", self._finished_step, path)

    def _write_snapshot(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        logger.info("memory snapshot written to %s", path)

    def _on_oom(self, device: int, alloc: int, device_alloc: int, device_free: int, *_: Any) -> None:
        """Called by the CUDA allocator when an allocation fails, before the OutOfMemoryError is raised."""
        path = self.snapshot_folder / f"oom_rank{self.rank}_memory_snapshot.pickle"
        logger.error(
            "CUDA out of memory on device %d (asked for %.2f GiB, %.2f GiB free); memory snapshot: %s",
            device,
            alloc / 2**30,
            device_free / 2**30,
            path,
        )
        self._write_snapshot(path)
