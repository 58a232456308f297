"""benchmarks/torchtitan_paper.py: every row of the paper's Tables 1-6 becomes a command whose overrides parse,
whose layout is the paper's, fits its GPU count, passes the model checks, and builds in the dry run.

The expected layouts below are typed from the paper's table captions, independently of the launcher.
"""

from __future__ import annotations

import re
import shlex

import pytest
import torch.distributed as dist

from tests.helpers import REPO, load_script
from titanium.config import load_config
from titanium.models import build_model_args, get_model_spec
from titanium.parallel.dims import ParallelDims

paper = load_script("benchmarks/torchtitan_paper.py")
launch = load_script("scripts/slurm/launch.py")

# id: (flavor, GPUs, (dp_shard, tp, pp, cp), local batch, global batch, seq_len, AC mode, compile, async TP, schedule)
F, T = False, True
EXPECTED = {
    "table1/fsdp": ("8B", 8, (8, 1, 1, 1), 2, 16, 8192, "selective", F, F, None),
    "table1/compile": ("8B", 8, (8, 1, 1, 1), 2, 16, 8192, "selective", T, F, None),
    "table1/compile_float8": ("8B", 8, (8, 1, 1, 1), 2, 16, 8192, "selective", T, F, None),
    "table2/fsdp": ("8B", 128, (128, 1, 1, 1), 2, 256, 8192, "selective", F, F, None),
    "table2/compile": ("8B", 128, (128, 1, 1, 1), 2, 256, 8192, "selective", T, F, None),
    "table2/compile_float8": ("8B", 128, (128, 1, 1, 1), 2, 256, 8192, "selective", T, F, None),
    "table3/2d": ("70B", 256, (32, 8, 1, 1), 16, 512, 8192, "full", T, F, None),
    "table3/async_tp": ("70B", 256, (32, 8, 1, 1), 16, 512, 8192, "full", T, T, None),
    "table4/1f1b": ("405B", 512, (4, 8, 16, 1), 32, 128, 8192, "full", T, T, "1F1B"),
    "table4/interleaved_1f1b": ("405B", 512, (4, 8, 16, 1), 32, 128, 8192, "full", T, T, "Interleaved1F1B"),
    "table5/fsdp8_cp1": ("8B", 8, (8, 1, 1, 1), 1, 8, 32768, "full", T, F, None),
    "table5/fsdp4_cp2": ("8B", 8, (4, 1, 1, 2), 1, 4, 65536, "full", T, F, None),
    "table5/fsdp2_cp4": ("8B", 8, (2, 1, 1, 4), 1, 2, 131072, "full", T, F, None),
    "table5/fsdp1_cp8": ("8B", 8, (1, 1, 1, 8), 1, 1, 262144, "full", T, F, None),
    "table6/fsdp8_cp1": ("405B", 512, (8, 8, 8, 1), 8, 64, 32768, "full", T, T, "1F1B"),
    "table6/fsdp4_cp2": ("405B", 512, (4, 8, 8, 2), 8, 32, 65536, "full", T, T, "1F1B"),
    "table6/fsdp2_cp4": ("405B", 512, (2, 8, 8, 4), 8, 16, 131072, "full", T, T, "1F1B"),
    "table6/fsdp1_cp8": ("405B", 512, (1, 8, 8, 8), 8, 8, 262144, "full", T, T, "1F1B"),
}
NO_TOKENIZER = ["--tokenizer.kind", "byte"]  # the Llama 3 tokenizer file is not in the repository


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def test_every_table_row_is_there():
    assert [r.id for r in paper.ROWS] == list(EXPECTED)


@pytest.mark.parametrize("row", paper.ROWS, ids=lambda r: r.id)
def test_sbatch_command_is_the_papers_layout(row):
    flavor, gpus, (dp, tp, pp, cp), local, global_, seq, ac, compiled, async_tp, schedule = EXPECTED[row.id]
    words = shlex.split(row.sbatch_command())
    config = words[0].removeprefix("CONFIG_FILE=")
    assert words[1:4] == ["sbatch", "--nodes", str(gpus // 8)]
    overrides = words[words.index("scripts/slurm/train.sbatch") + 1 :]
    cfg = load_config(["--job.config_file", config, *overrides, *NO_TOKENIZER])
    assert (cfg.model.flavor, cfg.training.local_batch_size, cfg.training.global_batch_size) == (flavor, local, global_)
    assert (cfg.training.seq_len, cfg.activation_checkpoint.mode) == (seq, ac)
    assert (cfg.compile.enable, cfg.compile.enable_async_tensor_parallel) == (compiled, async_tp)
    assert (cfg.training.steps, cfg.metrics.log_freq) == (100, 10)  # throughput read at step 90
    if schedule:
        assert cfg.parallelism.pipeline_parallel_schedule == schedule
    dims = ParallelDims.from_config(cfg.parallelism, gpus)
    assert (dims.dp_shard, dims.tp, dims.pp, dims.cp, dims.dp_replicate) == (dp, tp, pp, cp, 1)
    assert global_ == local * dims.dp_degree  # no gradient accumulation, as in the paper
    args = build_model_args(get_model_spec("llama3"), flavor, max_seq_len=seq)
    dims.check_model(args.decoder_args(), model=f"llama3 {flavor}", seq_len=seq)
    assert row.float8 == ("float8" in row.id or row.table >= 3)
    assert (cfg.float8.enable, cfg.float8.enable_fsdp_float8_all_gather) == (row.float8, row.float8)
    # what each node's launcher would run for this submission: the layout fits nodes x 8 GPUs
    slurm_env = {"SLURM_JOB_NUM_NODES": str(gpus // 8), "SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_NODELIST": "n[1-9]"}
    launch.torchrun_argv({**slurm_env, "CONFIG_FILE": config}, [*overrides, *NO_TOKENIZER])


def test_every_row_builds_in_the_dry_run(capsys):
    try:
        assert paper.main(["--dry-run"]) == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    worlds = re.findall(
        r"^world (\d+) = pp (\d+) x dp_replicate 1 x dp_shard (\d+) x cp (\d+) x tp (\d+)",
        capsys.readouterr().out,
        re.M,
    )
    expected = [(gpus, pp, dp, cp, tp) for _, gpus, (dp, tp, pp, cp), *_ in EXPECTED.values()]
    assert [tuple(map(int, w)) for w in worlds] == expected
