"""scripts/slurm: the torchrun command each node runs, built from SLURM's variables, without SLURM."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from tests.helpers import REPO, load_script
from titanium.config import ConfigError, load_config

launch = load_script("scripts/slurm/launch.py")

JOB = {
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_GPUS_ON_NODE": "8",
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu[017-020]",
    "CONFIG_FILE": "train_configs/llama3_8b.toml",
}
TOKENIZER = ("--tokenizer.kind", "byte")  # the Llama 3 tokenizer file is not in the repository


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def test_command_line_from_slurm_variables():
    argv = launch.torchrun_argv(JOB, ["--training.steps", "100", *TOKENIZER])
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert argv[3:10] == [
        "--nnodes=4", "--nproc_per_node=8", "--rdzv_id=4242", "--rdzv_backend=c10d",
        "--rdzv_endpoint=gpu017:29500", "--local-ranks-filter=0", "-m",
    ]  # fmt: skip
    train_args = argv[argv.index("titanium.train") + 1 :]
    assert train_args == ["--job.config_file", "train_configs/llama3_8b.toml", "--training.steps", "100", *TOKENIZER]
    cfg = load_config(train_args)
    assert (cfg.model.flavor, cfg.training.steps) == ("8B", 100)


def test_master_addr_port_and_gpu_count_variants():
    env = {**JOB, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29999", "NGPU": "4"}
    argv = launch.torchrun_argv(env, list(TOKENIZER))
    assert "--rdzv_endpoint=10.0.0.7:29999" in argv and "--nproc_per_node=4" in argv
    env = {k: v for k, v in JOB.items() if k != "SLURM_GPUS_ON_NODE"} | {"SLURM_GPUS_PER_NODE": "h100:8"}
    assert "--nproc_per_node=8" in launch.torchrun_argv(env, list(TOKENIZER))


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("node001", "node001"),
        ("gpu[017-020,031],cpu5", "gpu017"),
        ("rack2-n[07,09]", "rack2-n07"),
        ("a[3-4]-ib", "a3-ib"),
    ],
)
def test_first_host_of_a_nodelist(nodelist, host):
    assert launch.first_host(nodelist) == host


def test_layout_that_does_not_fit_the_job_fails_before_torchrun():
    with pytest.raises(ConfigError, match="world size 32"):
        launch.torchrun_argv(JOB, ["--parallelism.tensor_parallel_degree", "3", *TOKENIZER])
    with pytest.raises(ConfigError, match="NGPU"):
        launch.torchrun_argv({**JOB, "SLURM_GPUS_ON_NODE": "none"}, list(TOKENIZER))
    with pytest.raises(ConfigError, match="not inside a SLURM job"):
        launch.torchrun_argv({}, list(TOKENIZER))


def test_sbatch_script_with_fake_slurm_tools(tmp_path):
    """The sbatch script as SLURM would run it, with scontrol and srun replaced by stubs that print."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/sh\nprintf "gpu017\\ngpu018\\n"\n')
    (bin_dir / "srun").write_text('#!/bin/sh\necho "srun $*"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "NCCL_"))}
    env |= {**JOB, "SLURM_SUBMIT_DIR": str(REPO), "PATH": f"{bin_dir}:{os.environ['PATH']}", "NCCL_IB_HCA": "mlx5"}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run(
        ["bash", "scripts/slurm/train.sbatch", "--training.steps", "20", *TOKENIZER],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "export NCCL_IB_HCA=mlx5" in lines and "export NCCL_DEBUG=WARN" in lines
    command = shlex.split(next(line for line in lines if "torch.distributed.run" in line))
    assert "--rdzv_endpoint=gpu017:29500" in command and "--nnodes=4" in command
    assert lines[-1] == "srun --ntasks-per-node=1 --kill-on-bad-exit=1 python scripts/slurm/launch.py " + " ".join(
        ["--training.steps", "20", *TOKENIZER]
    )
    bad = subprocess.run(
        ["bash", "scripts/slurm/train.sbatch", "--parallelism.tensor_parallel_degree", "3", *TOKENIZER],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "srun" not in bad.stdout  # the check runs before srun
    assert "titanium: config error:" in bad.stderr and "Traceback" not in bad.stderr
