"""Which steps the profiler warms up on, records and saves: the window arithmetic, without processes."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.profiler import ProfilerAction

from titanium.config.sections import ProfilingSection
from titanium.debug.profiling import Profiler


def test_windows_end_at_multiples_of_freq_and_start_after_a_resume(tmp_path):
    cfg = ProfilingSection(enable_profiling=True, profile_freq=5, profiler_warmup=2, profiler_active=2)
    actions = [Profiler(cfg, tmp_path, rank=0)._action(step) for step in range(0, 11)]
    N, W, R, S = ProfilerAction.NONE, ProfilerAction.WARMUP, ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE
    assert actions == [N, N, W, W, R, S, N, W, W, R, S]
    resumed = Profiler(cfg, tmp_path, rank=0, start_step=8)
    assert [resumed._action(step) for step in (8, 9, 10)] == [N, R, S]  # steps before the resume never run


@pytest.mark.cuda  # memory snapshots are CUDA only
def test_cuda_snapshots_every_freq_steps_and_on_out_of_memory(tmp_path):
    cfg = ProfilingSection(enable_memory_snapshot=True, profile_freq=2, profiler_warmup=0)
    with Profiler(cfg, tmp_path, rank=0) as profiler:
        kept = torch.ones(1 << 20, device="cuda")
        profiler.step(1)
        profiler.step(2)
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(1 << 50, device="cuda")  # 1 PiB
    folder = tmp_path / "memory_snapshot"
    assert sorted(p.name for p in folder.iterdir()) == ["iteration_2", "oom_rank0_memory_snapshot.pickle"]
    with open(folder / "oom_rank0_memory_snapshot.pickle", "rb") as f:
        snapshot = pickle.load(f)
    sizes = [block["size"] for segment in snapshot["segments"] for block in segment["blocks"]]
    assert kept.numel() * 4 in sizes  # the live 4 MiB tensor is in the snapshot
