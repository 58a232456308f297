"""Unit tests for titanium.metrics: console line, throughput math, memory, peak FLOPs, loggers."""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
import time
import types

import pytest
import torch

from tests.helpers import texts
from titanium.config.sections import MetricsSection
from titanium.metrics import (
    MemoryMonitor,
    MetricsLogger,
    ThroughputTracker,
    WandbNotInstalledError,
    format_duration,
    format_log_line,
    get_peak_flops,
    peak_flops_from_name,
)
from titanium.metrics.table import Table

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_HAS_WANDB = importlib.util.find_spec("wandb") is not None


# --------------------------------------------------------------------------- console line


def _example_scalars(**overrides: float | None) -> dict[str, float | None]:
    scalars: dict[str, float | None] = {
        "loss": 7.1234,
        "grad_norm": 1.234,
        "lr": 3e-4,
        "tps": 1234.0,
        "tflops": 12.3,
        "mfu_pct": None,
        "mem_peak_gib": 1.23,
        "mem_peak_pct": 3.0,
        "data_pct": 2.0,
        "eta_s": 65.0,
    }
    scalars.update(overrides)
    return scalars


def test_log_line_without_mfu() -> None:
    line = format_log_line(10, 100, _example_scalars(), color=False)
    assert line == (
        "step   10/100  loss  7.1234  grad_norm  1.234  lr 3.00e-04  tok/s 1,234  "
        "tflops 12.3  mfu n/a  mem 1.23GiB (3%)  data 2%  eta 1m05s"
    )


def test_log_line_with_mfu_and_hours() -> None:
    line = format_log_line(1500, 20000, _example_scalars(mfu_pct=41.56, tps=123456.7, eta_s=3723.0), color=False)
    assert line.startswith("step  1500/20000  ")
    assert "mfu 41.6%" in line
    assert "tok/s 123,457" in line
    assert line.endswith("eta 1h02m03s")


def test_log_line_omits_missing_keys() -> None:
    line = format_log_line(1, 1000, {"loss": 2.0}, color=False)
    assert line == "step    1/1000  loss  2.0000"
    line = format_log_line(1, 10, {"loss": 2.0, "mem_peak_gib": 0.5}, color=False)
    assert line.endswith("mem 0.50GiB")  # no percentage when capacity is unknown


def test_log_line_memory_pressure_warnings() -> None:
    quiet = format_log_line(1, 10, {"mem_alloc_retries": 0.0, "mem_ooms": 0.0}, color=False)
    assert "retries" not in quiet and "ooms" not in quiet
    loud = format_log_line(1, 10, {"mem_alloc_retries": 3.0}, color=False)
    assert "alloc_retries 3" in loud


def test_log_line_shows_data_problems() -> None:
    """Skipped rows and truncated or dropped samples are on the console line, not only in TensorBoard."""
    scalars = {"loss": 2.0, "data/skipped_rows": 2.0, "data/truncated_samples": 1234.0, "data/dropped_samples": 5.0}
    line = format_log_line(1, 10, scalars, color=False)
    assert line.endswith("loss  2.0000  skipped_rows 2  truncated 1,234  dropped 5")
    assert _ANSI.sub("", format_log_line(1, 10, scalars, color=True)) == line


def test_log_line_color() -> None:
    plain = format_log_line(10, 100, _example_scalars(), color=False)
    colored = format_log_line(10, 100, _example_scalars(), color=True)
    assert "\x1b[" not in plain
    assert "\x1b[" in colored
    assert _ANSI.sub("", colored) == plain


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        (0.0, "0s"),
        (59.4, "59s"),
        (65.0, "1m05s"),
        (600.0, "10m00s"),
        (3600.0, "1h00m00s"),
        (3723.0, "1h02m03s"),
        (90061.0, "25h01m01s"),
        (None, "n/a"),
        (float("inf"), "n/a"),
    ],
)
def test_format_duration(seconds: float | None, expected: str) -> None:
    assert format_duration(seconds) == expected


# --------------------------------------------------------------------------- throughput


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(time, "perf_counter", fake)
    return fake


def _run_step(tracker: ThroughputTracker, clock: FakeClock, seconds: float, data: float, tokens: int) -> None:
    tracker.start_step()
    tracker.add_data_time(data)
    clock.t += seconds
    tracker.end_step(tokens)


def test_throughput_windows(clock: FakeClock) -> None:
    tracker = ThroughputTracker(flops_per_token=1e6, peak_flops=1e12)
    # Step 1: 10 s (compile), 0.5 s of it waiting for data.
    _run_step(tracker, clock, 10.0, 0.5, 1000)
    s = tracker.summary(step=1, total_steps=11)
    assert s["tps"] == pytest.approx(100.0)
    assert s["tflops"] == pytest.approx(100.0 * 1e6 / 1e12)
    assert s["mfu_pct"] == pytest.approx(100.0 * 100.0 * 1e6 / 1e12)
    assert s["step_time_s"] == pytest.approx(10.0)
    assert s["data_pct"] == pytest.approx(5.0)
    assert s["eta_s"] == pytest.approx(10 * 10.0)  # only the first step is known so far

    # Steps 2-5: 1 s each, 0.2 s data; the window is from the last summary.
    for _ in range(4):
        _run_step(tracker, clock, 1.0, 0.2, 1000)
    s = tracker.summary(step=5, total_steps=11)
    assert s["tps"] == pytest.approx(1000.0)
    assert s["mfu_pct"] == pytest.approx(0.1)
    assert s["step_time_s"] == pytest.approx(1.0)
    assert s["data_pct"] == pytest.approx(20.0)
    assert s["eta_s"] == pytest.approx(6.0)

    # Nothing happened since: empty summary, no division by zero.
    assert tracker.summary(step=5, total_steps=11) == {}


def test_throughput_eta_excludes_first_step(clock: FakeClock) -> None:
    tracker = ThroughputTracker(flops_per_token=1e6, peak_flops=1e12)
    _run_step(tracker, clock, 10.0, 0.0, 100)
    _run_step(tracker, clock, 1.0, 0.0, 100)
    _run_step(tracker, clock, 1.0, 0.0, 100)
    s = tracker.summary(step=3, total_steps=13)
    assert s["step_time_s"] == pytest.approx(4.0)  # honest mean, compile included
    assert s["tps"] == pytest.approx(300 / 12.0)
    assert s["eta_s"] == pytest.approx(10 * 1.0)  # but the ETA uses the steady-state steps


def test_throughput_without_peak_or_flops(clock: FakeClock) -> None:
    tracker = ThroughputTracker(flops_per_token=2e9, peak_flops=None)
    _run_step(tracker, clock, 2.0, 0.0, 4096)
    s = tracker.summary(step=1, total_steps=1)
    assert s["mfu_pct"] is None
    assert s["tflops"] == pytest.approx(2048 * 2e9 / 1e12)
    assert s["eta_s"] == 0.0

    tracker = ThroughputTracker()
    _run_step(tracker, clock, 2.0, 0.0, 4096)
    s = tracker.summary(step=1, total_steps=1)
    assert s["tflops"] is None and s["mfu_pct"] is None


def test_throughput_devices_sharing_batch(clock: FakeClock) -> None:
    tracker = ThroughputTracker(flops_per_token=1.0, peak_flops=None, devices_sharing_batch=4)
    _run_step(tracker, clock, 1.0, 0.0, 4000)
    assert tracker.summary(step=1, total_steps=2)["tps"] == pytest.approx(1000.0)
    with pytest.raises(ValueError):
        ThroughputTracker(devices_sharing_batch=0)


def test_end_step_without_start() -> None:
    with pytest.raises(RuntimeError):
        ThroughputTracker().end_step(1)


# --------------------------------------------------------------------------- device


@pytest.mark.parametrize(
    ("name", "flops"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA B200", 2.25e15),
        ("NVIDIA GB200", 2.5e15),
        ("NVIDIA L40S", 362e12),
        ("AMD Instinct MI300X", 1307e12),
        ("AMD Instinct MI325X", 1307e12),
        ("NVIDIA GeForce RTX 3090", None),
        ("NVIDIA L40", None),
    ],
)
def test_peak_flops_from_name(name: str, flops: float | None) -> None:
    assert peak_flops_from_name(name) == flops


def test_get_peak_flops_cpu_and_unknown(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    assert get_peak_flops(torch.device("cpu")) is None

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H100 80GB HBM3")
    assert get_peak_flops(torch.device("cuda", 0)) == 989e12

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Test Mystery GPU 9000")
    with caplog.at_level(logging.WARNING, logger="titanium.metrics.device"):
        assert get_peak_flops(torch.device("cuda", 0)) is None
        assert get_peak_flops(torch.device("cuda", 0)) is None
    warnings = [r for r in caplog.records if "Mystery" in r.getMessage()]
    assert len(warnings) == 1


def test_memory_monitor_cpu() -> None:
    mon = MemoryMonitor(torch.device("cpu"))
    mon.reset_peak()  # documented no-op on CPU
    stats = mon.stats()
    assert stats["mem_peak_gib"] is not None and stats["mem_peak_gib"] > 0
    capacity = mon.capacity_gib()
    if capacity is not None:
        assert 0 < stats["mem_peak_pct"] <= 100  # type: ignore[operator]
    assert mon.peak_reserved_gib() is None
    assert "mem_alloc_retries" not in stats


@pytest.mark.cuda
def test_memory_monitor_cuda() -> None:
    """Peaks are the allocator's, counted from what was alive before (other tests of the process may have left
    tensors on the GPU): 0.25 GiB more while a 0.25 GiB tensor lives, and back to the baseline after a reset."""
    mon = MemoryMonitor(torch.device("cuda"))
    baseline = torch.cuda.memory_allocated() / 2**30
    mon.reset_peak()
    x = torch.empty(256, 1024, 1024, dtype=torch.uint8, device="cuda")  # 0.25 GiB
    stats = mon.stats()
    assert stats["mem_peak_gib"] >= baseline + 0.25  # type: ignore[operator]
    assert stats["mem_peak_reserved_gib"] >= stats["mem_peak_gib"]  # type: ignore[operator]
    assert stats["mem_ooms"] == 0.0
    del x
    torch.cuda.empty_cache()
    mon.reset_peak()
    assert mon.peak_gib() == pytest.approx(baseline)


# --------------------------------------------------------------------------- logger


def _read_scalars(folder: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(folder)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_roundtrip(tmp_path) -> None:
    cfg = MetricsSection()
    with MetricsLogger(cfg, str(tmp_path), rank=0, run_config={"training": {"steps": 2}}) as ml:
        assert ml.active
        ml.log(1, {"loss": 7.5, "tps": 1000.0, "mfu_pct": None, "mem_peak_gib": 1.5})
        ml.log(2, {"loss": 6.25, "tps": 2000.0, "mfu_pct": None, "eval/loss": 6.0})
    scalars = _read_scalars(str(tmp_path / "tb"))
    assert scalars["loss_metrics/global_avg_loss"] == [(1, 7.5), (2, 6.25)]
    assert scalars["throughput/tps"] == [(1, 1000.0), (2, 2000.0)]
    assert scalars["memory/peak_gib"] == [(1, 1.5)]
    assert scalars["eval/loss"] == [(2, 6.0)]
    assert not any("mfu" in tag for tag in scalars)  # None values are skipped


def test_nonzero_rank_writes_nothing(tmp_path) -> None:
    ml = MetricsLogger(MetricsSection(), str(tmp_path), rank=1)
    assert not ml.active
    ml.log(1, {"loss": 1.0})
    ml.close()
    assert list(tmp_path.iterdir()) == []


def test_save_for_all_ranks(tmp_path) -> None:
    cfg = MetricsSection(save_for_all_ranks=True)
    for rank in (0, 1):
        with MetricsLogger(cfg, str(tmp_path), rank=rank) as ml:
            ml.log(3, {"loss": float(rank)})
    for rank in (0, 1):
        scalars = _read_scalars(str(tmp_path / "tb" / f"rank_{rank}"))
        assert scalars["loss_metrics/global_avg_loss"] == [(3, float(rank))]


def test_everything_disabled(tmp_path) -> None:
    cfg = MetricsSection(enable_tensorboard=False, enable_wandb=False)
    ml = MetricsLogger(cfg, str(tmp_path), rank=0)
    assert not ml.active
    ml.log(1, {"loss": 1.0})
    ml.close()
    ml.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("rank", [0, 1])
def test_wandb_missing_gives_clear_error(tmp_path, rank: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # behaves as not installed
    cfg = MetricsSection(enable_tensorboard=False, enable_wandb=True)
    with pytest.raises(WandbNotInstalledError, match=re.escape("pip install 'titanium[wandb]'")):
        MetricsLogger(cfg, str(tmp_path), rank=rank)


@pytest.mark.skipif(not _HAS_WANDB, reason="wandb is not installed")
def test_wandb_offline(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = MetricsSection(enable_tensorboard=False, enable_wandb=True, wandb_project="titanium-test")
    with MetricsLogger(cfg, str(tmp_path), rank=0, run_config={"a": 1}) as ml:
        assert ml.active
        ml.log(1, {"loss": 3.0, "mfu_pct": None})
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs, "W&B offline run folder was not created"


def test_run_name_names_the_wandb_run_and_a_tensorboard_folder(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    inits: list[dict] = []
    run = types.SimpleNamespace(log=lambda values, step: None, finish=lambda: None)
    fake = types.SimpleNamespace(init=lambda **kwargs: inits.append(kwargs) or run)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    cfg = MetricsSection(enable_wandb=True, run_name="lr-1e-4")
    with MetricsLogger(cfg, str(tmp_path), rank=0) as ml:
        ml.log(1, {"loss": 2.0})
    assert inits[0]["name"] == "lr-1e-4"
    assert _read_scalars(str(tmp_path / "tb" / "lr-1e-4"))["loss_metrics/global_avg_loss"] == [(1, 2.0)]


def test_objective_metrics_are_also_logged_under_trls_names(tmp_path) -> None:
    """Each objective declares TRL's names for its metrics (``Objective.trl_metric_names``); the logger adds them."""
    from titanium.objectives.dpo import DPOObjective
    from titanium.objectives.grpo import GRPOObjective

    aliases = {**DPOObjective.trl_metric_names, **GRPOObjective.trl_metric_names}
    with MetricsLogger(MetricsSection(), str(tmp_path), rank=0, aliases=aliases) as ml:
        ml.log(1, {"dpo/margin": 0.5, "dpo/accuracy": 0.75, "grpo/clip_frac": 0.1, "grpo/reward/exact_match": 0.25})
    scalars = _read_scalars(str(tmp_path / "tb"))
    assert scalars["dpo/margin"] == scalars["rewards/margins"] == [(1, 0.5)]
    assert scalars["rewards/accuracies"] == [(1, 0.75)] and scalars["clip_ratio"] == [(1, pytest.approx(0.1))]
    assert scalars["rewards/exact_match/mean"] == [(1, 0.25)]


def test_a_table_prints_aligned_and_cut_and_renders_as_markdown_whole() -> None:
    long_prompt = "system: be brief\nuser: what is 2 + 2?" * 3
    table = Table(("prompt", "completion", "reward"), [(long_prompt, "4 | four\nok", 1.0), ("hi", "x", 0.123456)])
    table = Table(table.columns, table.rows, cut_from_start=("prompt",))
    lines = table.text(width=20).splitlines()
    assert lines[0].split() == ["prompt", "completion", "reward"] and set(lines[1]) <= {"-", " "}
    assert lines[2].startswith("…" + long_prompt.replace("\n", " ⏎ ")[-19:])  # a prompt keeps its end
    assert "4 | four ⏎ ok" in lines[2] and lines[3].endswith("0.1235")
    assert len({line.index(cell) for line, cell in zip(lines[2:], ("4 |", "x"))}) == 1  # aligned
    markdown = table.markdown().splitlines()
    assert markdown[:2] == ["| prompt | completion | reward |", "|---|---|---|"]
    assert markdown[2] == f"| {long_prompt.replace(chr(10), '<br>')} | 4 \\| four<br>ok | 1 |"


def test_tables_go_to_tensorboard_text_and_to_wandb_tables(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    logged: list[tuple[dict, int]] = []
    run = types.SimpleNamespace(log=lambda values, step: logged.append((values, step)), finish=lambda: None)
    fake = types.SimpleNamespace(init=lambda **kwargs: run, Table=lambda columns, data: ("Table", columns, data))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    table = Table(("prompt", "reward"), [("2 + 2?", 1.0)])
    with MetricsLogger(MetricsSection(enable_wandb=True), str(tmp_path), rank=0) as ml:
        ml.log_table(3, "grpo/completions", table)
    assert logged == [({"grpo/completions": ("Table", ["prompt", "reward"], [["2 + 2?", 1.0]])}, 3)]
    assert texts(tmp_path / "tb", "grpo/completions") == {3: table.markdown()}
