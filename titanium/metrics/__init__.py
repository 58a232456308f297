"""What the training loop logs: throughput/MFU, memory, a console line, TensorBoard and W&B.

Per log step the loop gathers one flat ``dict[str, float | None]`` of scalars (its own ``loss``,
``grad_norm``, ``lr``; :meth:`ThroughputTracker.summary`; :meth:`MemoryMonitor.stats`) and
hands the same dict to :func:`format_log_line` and :meth:`MetricsLogger.log`, so the console
and the dashboards can never disagree.
"""

from titanium.metrics.console import format_duration, format_log_line
from titanium.metrics.device import MemoryMonitor, get_peak_flops, peak_flops_from_name
from titanium.metrics.logger import SCALAR_TAGS, MetricsLogger, WandbNotInstalledError
from titanium.metrics.throughput import ThroughputTracker

__all__ = [
    "SCALAR_TAGS",
    "MemoryMonitor",
    "MetricsLogger",
    "ThroughputTracker",
    "WandbNotInstalledError",
    "format_duration",
    "format_log_line",
    "get_peak_flops",
    "peak_flops_from_name",
]
