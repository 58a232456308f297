"""[comm] Flight Recorder and [profiling] settings: range checks, and the environment torch reads."""

from __future__ import annotations

import os

import pytest

from titanium.config import ConfigError, load_config
from titanium.config.sections import CommSection
from titanium.debug.flight_recorder import FlightRecorder


@pytest.mark.parametrize(
    "args, message",
    [
        (["--comm.trace_buf_size", "-1"], "--comm.trace_buf_size must be >= 0"),
        (["--comm.save_traces_folder", " "], "--comm.save_traces_folder must name a folder"),
        (["--profiling.profile_freq", "0"], "--profiling.profile_freq must be >= 1"),
        (["--profiling.profiler_active", "0"], "--profiling.profiler_active must be >= 1"),
        (["--profiling.profiler_warmup", "-1"], "--profiling.profiler_warmup must be >= 0"),
        (["--profiling.profile_freq", "3", "--profiling.profiler_warmup", "3"], "must fit in --profiling.profile_freq"),
        (["--profiling.save_memory_snapshot_folder", ""], "--profiling.save_memory_snapshot_folder must name"),
    ],
)
def test_bad_values_are_config_errors(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config(args)


@pytest.fixture
def clean_fr_env(monkeypatch):
    """No Flight Recorder variables, and whatever the recorder sets is undone after the test."""
    for key in ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "WORLD_SIZE"):
        monkeypatch.setenv(key, "")  # recorded, so teardown restores the original state
        monkeypatch.delenv(key)
    return monkeypatch


def test_recorder_sizes_torchs_buffer_before_the_process_group(clean_fr_env, tmp_path):
    with FlightRecorder(CommSection(trace_buf_size=123), tmp_path) as recorder:
        assert os.environ["TORCH_FR_BUFFER_SIZE"] == "123"
        assert recorder._thread is None  # one process: nobody to wait for, no watchdog
    with FlightRecorder(CommSection(trace_buf_size=0), tmp_path / "off"):
        assert os.environ["TORCH_FR_BUFFER_SIZE"] == "123"  # off: the environment is left alone


def test_the_environment_wins_over_the_config(clean_fr_env, tmp_path, caplog):
    clean_fr_env.setenv("TORCH_FR_BUFFER_SIZE", "7")
    with FlightRecorder(CommSection(trace_buf_size=123), tmp_path):
        assert os.environ["TORCH_FR_BUFFER_SIZE"] == "7"
    assert "TORCH_FR_BUFFER_SIZE=7 from the environment wins" in caplog.text
