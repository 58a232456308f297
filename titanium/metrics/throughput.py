"""Tokens/s, TFLOP/s, MFU, data-loading share and ETA, measured per logging window.

The tracker only ever reads the host clock and adds Python numbers: it never touches a tensor,
so calling it every step cannot introduce a device synchronisation. Everything it reports is
derived from *window* wall time (from the previous summary to this one) rather than from
per-step host intervals, because with an asynchronous accelerator the host may run ahead of the
device between sync points, which makes individual step intervals unreliable while the window
total (which ends after the loop has synchronised, e.g. to read the loss) is exact.

Typical use in the training loop::

    tracker = ThroughputTracker(flops_per_token=model_flops_per_token, peak_flops=get_peak_flops(dev))
    for step in range(start + 1, total + 1):
        tracker.start_step()
        t0 = time.perf_counter(); batch = next(data_iter); tracker.add_data_time(time.perf_counter() - t0)
        ...forward / backward / optimizer...
        tracker.end_step(tokens=batch_tokens_on_this_rank)
        if should_log(step):
            loss = loss.item()  # the sync happens here, before summary() reads the clock
            scalars = {"loss": loss, **tracker.summary(step, total)}
"""

from __future__ import annotations

import time

__all__ = ["ThroughputTracker"]


def _now() -> float:
    # Looked up on the module at call time so tests can monkeypatch `time.perf_counter`.
    return time.perf_counter()


class ThroughputTracker:
    """Accumulates step timings and token counts between two log steps.

    Args:
        flops_per_token: Model FLOPs for one token, forward + backward (e.g. 6·N plus the
            attention term); None disables ``tflops`` and ``mfu_pct``.
        peak_flops: Peak FLOP/s of one device (see :func:`titanium.metrics.get_peak_flops`);
            None (CPU, unknown GPU) makes ``mfu_pct`` None, shown as "n/a".
        devices_sharing_batch: How many devices jointly process the tokens this rank passes to
            :meth:`end_step`. 1 for DDP/FSDP/HSDP, where every rank consumes its own batch.
            With tensor / context / pipeline parallelism several devices work on the same
            tokens, so set it to their product (or have the loop pass already-divided counts
            and leave it at 1 — but not both).

    "Per device" means: tokens this rank processed, divided by ``devices_sharing_batch``, over
    the wall time of the window. Summing ``tps`` over all devices gives the job's throughput.
    """

    def __init__(
        self,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        devices_sharing_batch: int = 1,
    ) -> None:
        if devices_sharing_batch < 1:
            raise ValueError(f"devices_sharing_batch must be >= 1, got {devices_sharing_batch}")
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.devices_sharing_batch = devices_sharing_batch
        self._first_step_seen = False  # has any step ever completed (run-wide, not per window)
        self._reset_window(start=None)

    def _reset_window(self, start: float | None) -> None:
        self._window_start = start
        self._tokens = 0
        self._steps = 0
        self._data_time = 0.0
        self._prepare_time = 0.0
        self._step_start: float | None = None
        # Host duration of the run's very first step if it lies in this window (compile/warmup).
        self._first_step_time: float | None = None

    def start_step(self) -> None:
        """Mark the beginning of a step. Opens the window if this is the first step since start."""
        now = _now()
        if self._window_start is None:
            self._window_start = now
        self._step_start = now

    def add_data_time(self, seconds: float) -> None:
        """Add host time spent waiting for the data loader (may be called several times per step,
        e.g. once per gradient-accumulation microbatch)."""
        self._data_time += seconds

    def add_prepare_time(self, seconds: float) -> None:
        """Add time an objective spent in its no-grad prepare phase (reference log-probs, rollouts)."""
        self._prepare_time += seconds

    def end_step(self, tokens: int) -> None:
        """Close a step that processed ``tokens`` tokens on this rank (a Python int, no sync)."""
        now = _now()
        if self._step_start is None:
            raise RuntimeError("ThroughputTracker.end_step() called without start_step()")
        if not self._first_step_seen:
            self._first_step_seen = True
            self._first_step_time = now - self._step_start
        self._step_start = None
        self._tokens += tokens
        self._steps += 1

    def summary(self, step: int, total_steps: int) -> dict[str, float | None]:
        """Metrics of the window since the previous summary, then start a new window.

        Returns ``tps`` (tokens/s per device), ``tflops`` (achieved TFLOP/s per device),
        ``mfu_pct`` (``tflops`` as % of peak; None without a known peak), ``step_time_s`` (mean
        wall time per step in the window), ``data_pct`` (% of the window spent waiting for data),
        ``prepare_pct`` (% in objectives' prepare phase, when there is one)
        and ``eta_s`` (steps left × mean step time). The very first step of the run includes
        compilation and warm-up, so it is left out of the ETA estimate whenever the window holds
        later steps too. Returns an empty dict if no step finished since the last summary.

        The window ends *now*, so call this after the loop has synchronised with the device
        (e.g. after ``loss.item()``); the next window starts now as well, so time spent between
        log steps on checkpoints or evaluation counts against throughput, as it does in reality.
        """
        now = _now()
        if self._steps == 0 or self._window_start is None:
            return {}
        elapsed = max(now - self._window_start, 1e-12)
        tps = self._tokens / self.devices_sharing_batch / elapsed
        out: dict[str, float | None] = {"tps": tps, "tflops": None, "mfu_pct": None}
        if self.flops_per_token is not None:
            achieved = tps * self.flops_per_token
            out["tflops"] = achieved / 1e12
            if self.peak_flops:
                out["mfu_pct"] = 100.0 * achieved / self.peak_flops
        step_time = elapsed / self._steps
        out["step_time_s"] = step_time
        out["data_pct"] = 100.0 * min(self._data_time / elapsed, 1.0)
        if self._prepare_time:
            out["prepare_pct"] = 100.0 * min(self._prepare_time / elapsed, 1.0)

        eta_step_time = step_time
        if self._first_step_time is not None and self._steps > 1:
            eta_step_time = max(elapsed - self._first_step_time, 0.0) / (self._steps - 1)
        out["eta_s"] = max(total_steps - step, 0) * eta_step_time

        self._reset_window(start=now)
        return out
