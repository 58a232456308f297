"""Which steps the profiler warms up on, records and saves: the window arithmetic, without processes."""

from __future__ import annotations

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
