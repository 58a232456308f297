"""Bad input ends the run with one message and exit code 2, and config mistakes are caught before any
process group exists (and, through run_train.sh, before torchrun starts a worker)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO, env, tiny_args, train_cmd
from titanium.config import ConfigError, load_config
from titanium.parallel.dims import ParallelDims
from titanium.preflight import check_job
from titanium.train import main

CONFIG_MISTAKES = [
    (
        ("--model.name", "gpt5"),
        "--model.name 'gpt5' is not a known model; known models: gemma2, llama3, mistral, phi3, qwen2, qwen3, "
        "qwen3_moe",
    ),
    (("--model.flavor", "7B"), "--model.flavor '7B' is not a flavor of llama3; valid flavors: debugmodel, 1B, 3B"),
    (
        ("--training.global_batch_size", "6"),
        "--training.global_batch_size 6 must be a multiple of --training.local_batch_size x data-parallel degree "
        "= 4 x 1 = 4 (e.g. 4, 8, 12, ...)",
    ),
]


@pytest.mark.parametrize("args, message", CONFIG_MISTAKES)
def test_config_mistakes_exit_2_before_any_process_group(tmp_path, capsys, no_process_group, args, message):
    assert main(tiny_args(tmp_path, *args)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"titanium: config error: {message}") and err.count("\n") == 1, err


def test_batch_check_counts_every_data_parallel_rank():
    cfg = load_config(["--training.local_batch_size", "2", "--training.global_batch_size", "12"])
    dims = ParallelDims.from_config(cfg.parallelism, 4)
    assert dims.grad_accum_steps(2, 16) == 2  # 2 per rank x 4 ranks x 2 microbatches
    assert dims.grad_accum_steps(2, -1) == 1
    with pytest.raises(ConfigError, match="= 2 x 4 = 8"):
        check_job(cfg, 4)
    assert check_job(cfg, 3).dp_degree == 3  # 12 = 2 x 3 x 2


def test_initial_load_path_without_a_checkpoint_is_refused(tmp_path, capsys, no_process_group):
    """An empty folder (or a run's checkpoint folder instead of one of its step-N) used to be ignored
    silently, and the run trained from scratch; checkpointing on or off, it is now an error."""
    empty, run_folder = tmp_path / "empty", tmp_path / "checkpoint"
    empty.mkdir()
    (run_folder / "step-30").mkdir(parents=True)
    (run_folder / "step-30/.metadata").write_bytes(b"")
    for path, hint in ((empty, "point at a step-N folder (it holds"), (run_folder, f"such as {run_folder}/step-30")):
        for enable in ("--checkpoint.enable", "--checkpoint.no_enable"):
            assert main([*tiny_args(tmp_path / "run"), enable, "--checkpoint.initial_load_path", str(path)]) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"titanium: error: --checkpoint.initial_load_path: checkpoint {path}: no .metadata")
            assert hint in err and "--checkpoint.initial_load_in_hf for a Hugging Face folder" in err


def write_bad_inputs(tmp_path):
    """A tokenizer file that is not one, and a data file none of whose rows has the text column."""
    (tmp_path / "bad.tiktoken").write_text("not a tokenizer\n")
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps({"body": f"row {i}"}) + "\n" for i in range(20)))
    return [
        (("--tokenizer.path", str(tmp_path / "bad.tiktoken")), "bad.tiktoken:1: not a 'base64_token rank' line"),
        (
            ("--data.path", str(tmp_path / "bad.jsonl")),
            "nothing to train on (20 bad rows skipped: check the file's columns",
        ),
    ]


def test_input_errors_found_at_run_time_exit_2(tmp_path, capsys):
    """These are met after the process group exists (they exited 1 before); one line each, no traceback."""
    for args, message in write_bad_inputs(tmp_path):
        assert main(tiny_args(tmp_path / "run", *args)) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("titanium: error: ") == 1, err


def test_torchrun_prints_the_message_once(tmp_path):
    (args, message), _ = write_bad_inputs(tmp_path)
    cmd = train_cmd(tiny_args(tmp_path / "run", *args), nproc=2)
    result = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode != 0  # torchrun's own code (1) when a worker fails; the worker exited 2
    assert result.stderr.count(message) == 1, result.stderr[-3000:]
    assert "exitcode  : 2" in result.stderr


def run_script(*args: str, ngpu: int = 2) -> subprocess.CompletedProcess:
    script_env = {**env(), "NGPU": str(ngpu), "MASTER_PORT": "0", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        ["./run_train.sh", *args], cwd=REPO, env=script_env, capture_output=True, text=True, timeout=300
    )


def test_run_train_sh_checks_the_config_before_torchrun(tmp_path):
    start = time.perf_counter()
    result = run_script("--job.dump_folder", str(tmp_path), "--model.flavor", "7B")
    elapsed = time.perf_counter() - start
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().endswith("--model.flavor '7B' is not a flavor of llama3; valid flavors: "
                                          "debugmodel, 1B, 3B, 8B, 70B, 405B")  # fmt: skip
    assert "Traceback" not in result.stderr and "[titanium rank" not in result.stderr  # no worker started
    assert not tmp_path.joinpath("config.toml").exists()
    print(f"pre-flight failure in {elapsed:.1f}s")


def test_preflight_passes_a_good_job():
    args = ["--job.config_file", "train_configs/debug_model.toml"]
    result = subprocess.run(
        [sys.executable, "-m", "titanium.preflight", *args],
        cwd=REPO,
        env={**env(), "WORLD_SIZE": "2"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and "titanium:" not in result.stderr, result.stderr
    assert os.access(REPO / "run_train.sh", os.X_OK)
