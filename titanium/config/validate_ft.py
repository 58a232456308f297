"""Checks of the [fault_tolerance] section (kept apart from validate.py so the feature stays in one place)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

from titanium.config.components import JobConfig


def validate_fault_tolerance(cfg: JobConfig) -> Iterator[str]:
    """Ranges, and the layouts fault tolerance does not support, as one sentence each."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        return
    if ft.group_size < 1:
        yield f"--fault_tolerance.group_size must be >= 1 (the number of replica groups), got {ft.group_size}"
    elif not 0 <= ft.replica_id < ft.group_size:
        yield f"--fault_tolerance.replica_id must be in 0..{ft.group_size - 1} (group_size - 1), got {ft.replica_id}"
    if not 1 <= ft.min_replica_size <= max(ft.group_size, 1):
        yield (
            f"--fault_tolerance.min_replica_size must be in 1..group_size ({ft.group_size}), got {ft.min_replica_size}"
        )
    for key in ("timeout_seconds", "quorum_timeout_seconds"):
        if getattr(ft, key) <= 0:
            yield f"--fault_tolerance.{key} must be > 0, got {getattr(ft, key)}"
    if ft.sync_steps < 1:
        yield f"--fault_tolerance.sync_steps must be >= 1, got {ft.sync_steps}"
    if not ft.lighthouse and not os.environ.get("TORCHFT_LIGHTHOUSE"):
        yield (
            "--fault_tolerance.enable needs the lighthouse address: set --fault_tolerance.lighthouse "
            "http://HOST:PORT or the TORCHFT_LIGHTHOUSE variable (start one with torchft_lighthouse --bind HOST:PORT)"
        )
    if cfg.parallelism.pipeline_parallel_degree > 1:
        yield (
            "--fault_tolerance.enable does not support pipeline parallelism yet: set "
            "--parallelism.pipeline_parallel_degree 1 (use FSDP/TP inside each replica group)"
        )
    if cfg.optimizer.early_step_in_backward:
        yield (
            "--fault_tolerance.enable cannot use --optimizer.early_step_in_backward: the optimizer must wait for the "
            "gradients of the other replica groups and for the commit vote, which come after the backward"
        )
    if importlib.util.find_spec("torchft") is None:
        yield "--fault_tolerance.enable needs torchft: pip install 'titanium[ft]' (or pip install torchft)"
