"""One human-readable console line per log step.

The line is meant to be scanned by eye over hundreds of steps, so fields keep a fixed order and
width where it matters (step counter, loss), numbers are formatted for their scale (commas for
tokens/s, scientific for the learning rate, h/m/s for the ETA) and colors are plain ANSI codes,
off whenever the output is not a terminal or the user asks (``metrics.disable_color_printing``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

__all__ = ["format_duration", "format_log_line"]

_RESET = "\033[0m"
_COLORS = {
    "step": "\033[36m",  # cyan
    "loss": "\033[32m",  # green
    "grad_norm": "\033[33m",  # yellow
    "lr": "\033[37m",  # white/grey
    "tps": "\033[34m",  # blue
    "tflops": "\033[34m",
    "mfu_pct": "\033[34m",
    "mem": "\033[35m",  # magenta
    "data_pct": "\033[37m",
    "eta_s": "\033[37m",
    "warn": "\033[31m",  # red
    "data/skipped_rows": "\033[31m",
    "data/truncated_samples": "\033[33m",  # yellow
    "data/dropped_samples": "\033[33m",
    "data/truncated_prompts": "\033[33m",
    "guards/skipped_steps": "\033[31m",
}

_NA = "n/a"


def format_duration(seconds: float | None) -> str:
    """Render a duration as ``42s``, ``1m05s`` or ``2h03m07s`` (minutes and seconds zero-padded
    after the leading unit so successive lines line up)."""
    if seconds is None or not math.isfinite(seconds):
        return _NA
    total = round(max(float(seconds), 0.0))
    hours, rem = divmod(total, 3600)
    minutes, secs = divmod(rem, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def _fmt(value: float | None, spec: str | Callable[[float], str]) -> str:
    if value is None:
        return _NA
    if callable(spec):
        return spec(float(value))
    return format(float(value), spec)


def format_log_line(
    step: int,
    total_steps: int,
    scalars: Mapping[str, float | None],
    color: bool,
    extra_keys: Sequence[str] = (),
) -> str:
    """Format one log line, e.g.
    ``step   10/100  loss  7.1234  grad_norm  1.234  lr 3.00e-04  tok/s 1,234  tflops 12.3
    mfu n/a  mem 1.23GiB (3%)  data 2%  eta 1m05s``.

    Uses the scalar keys produced by the loop, :class:`~titanium.metrics.ThroughputTracker` and
    :class:`~titanium.metrics.MemoryMonitor`: ``loss``, ``grad_norm``, ``lr``, ``tps``,
    ``tflops``, ``mfu_pct``, ``mem_peak_gib`` / ``mem_peak_pct``, ``data_pct``, ``eta_s``, and
    ``mem_alloc_retries`` / ``mem_ooms`` (shown, in red, only when non-zero because they signal
    memory pressure), ``guards/skipped_steps`` (steps not applied because their loss or gradient norm
    was not finite; present only when non-zero), and the objectives' data counters ``data/skipped_rows``,
    ``data/truncated_samples``, ``data/dropped_samples`` and ``data/truncated_prompts`` (present only when
    non-zero). A key missing from ``scalars`` is omitted; a key present with value None prints ``n/a`` (e.g. MFU on
    CPU), so the reader sees the metric exists but is unavailable. ``extra_keys`` (an objective's
    metrics, e.g. ``dpo/accuracy``, and its counters, e.g. ``grpo/long_prompts_skipped``) follow the loss, named by
    their last part (a key shown above already is not repeated). Other keys are ignored
    here (they still go to TensorBoard / W&B).
    """

    def paint(key: str, text: str) -> str:
        return f"{_COLORS[key]}{text}{_RESET}" if color else text

    width = max(4, len(str(total_steps)))
    parts = [paint("step", f"step {step:>{width}}/{total_steps}")]

    simple: tuple[tuple[str, str, str | Callable[[float], str]], ...] = (
        ("loss", "loss", "7.4f"),
        ("guards/skipped_steps", "skipped_steps", ",.0f"),
        ("grad_norm", "grad_norm", "6.3f"),
        ("lr", "lr", ".2e"),
        ("tps", "tok/s", ",.0f"),
        ("tflops", "tflops", ".1f"),
        ("mfu_pct", "mfu", lambda v: f"{v:.1f}%"),
        ("data/skipped_rows", "skipped_rows", ",.0f"),
        ("data/truncated_samples", "truncated", ",.0f"),
        ("data/dropped_samples", "dropped", ",.0f"),
        ("data/truncated_prompts", "prompts_cut", ",.0f"),
    )
    for key, label, spec in simple:
        if key in scalars:
            parts.append(paint(key, f"{label} {_fmt(scalars[key], spec)}"))

    for key in extra_keys:
        if key in scalars and not any(key == shown for shown, _, _ in simple):
            parts.append(f"{key.rsplit('/', 1)[-1]} {_fmt(scalars[key], '.4g')}")

    if "mem_peak_gib" in scalars:
        text = f"mem {_fmt(scalars['mem_peak_gib'], lambda v: f'{v:.2f}GiB')}"
        pct = scalars.get("mem_peak_pct")
        if pct is not None:
            text += f" ({pct:.0f}%)"
        parts.append(paint("mem", text))
    for key, label in (("mem_alloc_retries", "alloc_retries"), ("mem_ooms", "ooms")):
        value = scalars.get(key)
        if value:
            parts.append(paint("warn", f"{label} {int(value)}"))

    if "data_pct" in scalars:
        parts.append(paint("data_pct", f"data {_fmt(scalars['data_pct'], lambda v: f'{v:.0f}%')}"))
    if (scalars.get("prepare_pct") or 0) >= 0.5:  # only objectives with a prepare phase spend time there
        parts.append(paint("data_pct", f"prepare {_fmt(scalars['prepare_pct'], lambda v: f'{v:.0f}%')}"))
    if "eta_s" in scalars:
        parts.append(paint("eta_s", f"eta {_fmt(scalars['eta_s'], format_duration)}"))
    return "  ".join(parts)
