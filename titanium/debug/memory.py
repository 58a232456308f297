"""Peak memory of one piece of work, on CPU as on CUDA: what a memory optimization buys, measured.

CUDA has allocator statistics; the CPU allocator has none, so on CPU the profiler records every allocation
and free (``profile_memory=True``) and the peak is the highest running total. Both count only what the work
allocates beyond what already existed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def peak_memory_bytes(work: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Bytes allocated by ``work()`` at its peak, beyond what was allocated before it started."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        work()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        work()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type().name == "CPU"),
        key=lambda e: e.start_ns(),
    )
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return peak
