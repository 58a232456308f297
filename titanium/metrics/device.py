"""What the hardware can do (peak FLOP/s) and how much memory the run has used.

MFU is only meaningful against a well-defined peak, so the table below follows one convention:
the vendor's *dense* BF16 tensor-core number (no 2:4 structured sparsity, which marketing sheets
often quote as the headline and which would halve every MFU we report). Unknown hardware gets
``None`` rather than a guess, so a wrong MFU is never printed.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

__all__ = ["MemoryMonitor", "get_peak_flops", "peak_flops_from_name"]

logger = logging.getLogger(__name__)

_GIB = float(1 << 30)

# (substring of the lower-cased device name, dense bf16 FLOP/s). Order matters: the first match
# wins, so more specific names (GB200 before B200, H100 PCIe/NVL before plain H100) come first.
_PEAK_BF16_DENSE: tuple[tuple[str, float], ...] = (
    ("gb200", 2.5e15),
    ("b200", 2.25e15),
    ("h200", 989e12),
    ("h100 nvl", 835e12),
    ("h100 pcie", 756e12),
    ("h100", 989e12),  # SXM5; CUDA reports it as e.g. "NVIDIA H100 80GB HBM3"
    ("a100", 312e12),
    ("l40s", 362e12),
    ("mi325x", 1307e12),
    ("mi300x", 1307e12),
)

_warned_unknown: set[str] = set()


def peak_flops_from_name(name: str) -> float | None:
    """Dense BF16 peak FLOP/s for a device name as CUDA/ROCm reports it, or None if unknown.

    Split out from :func:`get_peak_flops` so the table can be tested without a GPU. Matching is a
    case-insensitive substring search because drivers decorate names ("NVIDIA H100 80GB HBM3",
    "AMD Instinct MI300X") and we only care about the chip.
    """
    lowered = name.lower()
    for key, flops in _PEAK_BF16_DENSE:
        if key in lowered:
            return flops
    return None


def get_peak_flops(device: torch.device) -> float | None:
    """Peak dense BF16 FLOP/s of one accelerator, used as the MFU denominator.

    Source convention: the vendor data-sheet figure for dense BF16 tensor-core math *without*
    structured sparsity (e.g. H100 SXM 989 TFLOP/s, not the 1979 "with sparsity" figure).

    Returns None on CPU (there is no meaningful tensor-core peak, so MFU is reported as n/a) and
    for GPUs missing from the table; the latter logs a warning once per device name so the user
    knows why MFU is missing without the log being flooded every step.
    """
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    flops = peak_flops_from_name(name)
    if flops is None and name not in _warned_unknown:
        _warned_unknown.add(name)
        logger.warning(
            "Peak FLOP/s of GPU %r is unknown; MFU will be reported as n/a. "
            "Add it to titanium/metrics/device.py (dense BF16, no sparsity).",
            name,
        )
    return flops


def _cpu_peak_rss_bytes() -> int | None:
    """Peak resident set size of this process, or None where `resource` does not exist (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS reports bytes.
    return int(maxrss) if sys.platform == "darwin" else int(maxrss) * 1024


def _cpu_total_bytes() -> int | None:
    """Physical memory of the host, or None where sysconf cannot tell."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


class MemoryMonitor:
    """Peak memory of one device over a logging window.

    The loop calls :meth:`stats` at each log step (its keys are the ``mem_*`` scalars that
    :class:`~titanium.metrics.MetricsLogger` and :func:`~titanium.metrics.format_log_line`
    understand) and then :meth:`reset_peak`, so each logged value is the peak of that window
    rather than of the whole run, which is what reveals a leak or a spike at a given step.

    On CUDA it reads the caching allocator: peak *allocated* (live tensors) and peak *reserved*
    (what the allocator holds from the driver, which is what actually runs out), plus
    ``num_alloc_retries`` (the allocator had to free its cache and retry: a sign of
    fragmentation / memory pressure that slows steps) and ``num_ooms``.

    On CPU it reports the process's peak RSS from ``resource.getrusage``. The kernel keeps that
    high-water mark for the process lifetime and offers no way to reset it, so on CPU
    :meth:`reset_peak` is a no-op and the value is the peak since the process started.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        if self._cuda and device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

    def reset_peak(self) -> None:
        """Start a new peak window (CUDA only; CPU peak RSS cannot be reset)."""
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float:
        """Peak allocated memory since the last reset (CUDA) or peak RSS of the process (CPU)."""
        if self._cuda:
            return torch.cuda.max_memory_allocated(self.device) / _GIB
        rss = _cpu_peak_rss_bytes()
        return 0.0 if rss is None else rss / _GIB

    def peak_reserved_gib(self) -> float | None:
        """Peak memory held by the CUDA caching allocator since the last reset; None on CPU."""
        if self._cuda:
            return torch.cuda.max_memory_reserved(self.device) / _GIB
        return None

    def capacity_gib(self) -> float | None:
        """Total memory of the device (CUDA) or of the host (CPU); None if it cannot be read."""
        if self._cuda:
            return torch.cuda.get_device_properties(self.device).total_memory / _GIB
        total = _cpu_total_bytes()
        return None if total is None else total / _GIB

    def stats(self) -> dict[str, float | None]:
        """All memory scalars for one log step, keyed the way the logger and console expect.

        Keys: ``mem_peak_gib``, ``mem_peak_pct`` (of capacity) and, on CUDA only,
        ``mem_peak_reserved_gib``, ``mem_alloc_retries``, ``mem_ooms``. Call before
        :meth:`reset_peak`.
        """
        peak = self.peak_gib()
        capacity = self.capacity_gib()
        out: dict[str, float | None] = {
            "mem_peak_gib": peak,
            "mem_peak_pct": (100.0 * peak / capacity) if capacity else None,
        }
        if self._cuda:
            mem = torch.cuda.memory_stats(self.device)
            out["mem_peak_reserved_gib"] = self.peak_reserved_gib()
            out["mem_alloc_retries"] = float(mem.get("num_alloc_retries", 0))
            out["mem_ooms"] = float(mem.get("num_ooms", 0))
        return out
