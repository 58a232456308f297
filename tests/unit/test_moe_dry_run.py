"""The dry run plans expert parallelism and estimates MoE memory without tracing data-dependent routing: the
shipped Qwen3-MoE configs at 8, 64 and 256 ranks fit an 80 GB GPU, each estimate in under a minute."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from tests.helpers import REPO
from titanium.tools.dry_run import dry_run, main


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_30b_a3b_on_64_ranks_divides_the_experts(in_repo):
    run = dry_run(["--job.config_file", "train_configs/qwen3_30b_a3b.toml"], world_size=64, rank=9)
    assert (run.dims.dp_shard, run.dims.ep) == (64, 8)
    params = {p.name: p for p in run.params}
    w1 = params["layers.47.moe.experts.w1"]
    assert w1.global_shape == (128, 768, 2048) and w1.mesh_dims == ("efsdp", "ep")
    assert w1.local_shape == (2, 768, 2048)  # 128 experts / 8 (ep) / 8 (FSDP over efsdp)
    assert params["layers.0.moe.router.gate.weight"].mesh_dims == ("dp_shard",)
    total = sum(p.numel() for p in run.model.parameters())
    assert run.local_numel == pytest.approx(total / 64, rel=0.01)


@pytest.mark.parametrize("config, world", [("qwen3_30b_a3b", 8), ("qwen3_30b_a3b", 64), ("qwen3_235b_a22b", 256)])
def test_the_shipped_moe_plans_fit_an_h100(in_repo, capsys, config, world):
    start = time.perf_counter()
    assert main(["--job.config_file", f"train_configs/{config}.toml", "--world_size", str(world)]) == 0
    assert time.perf_counter() - start < 60, config
    out = capsys.readouterr().out
    assert "% of 78 GiB: fits" in out and "receives 1.25x its even share" in out, out[-2000:]
