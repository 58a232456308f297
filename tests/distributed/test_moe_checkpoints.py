"""Checkpoints of an expert-parallel run: DCP resume at the same and at other expert-parallel degrees, and the
Hugging Face export of an EP layout.

One 4-process launch (``moe_worker``), data-parallel degree 4 throughout (a data position belongs to one DP
layout). A run at EP 4 saves at step 4 and trains to step 8, with the aux-loss-free bias (so the bias, a buffer,
must travel with the checkpoint too). Jobs resume its step-4 checkpoint at EP 4, EP 2 (x FSDP 2) and EP 1 (FSDP 4)
and must repeat steps 5-8: losses to 1e-6 relative at EP 4, 1e-5 at the others, per-expert counts identical.
An EP 4 run exports to Hugging Face format like one process does: the same files and keys (one tensor per
expert), norm weights to 1e-6, matrices to 2e-4 (Adam turns rounding-level gradient differences into updates of
up to lr on a few near-zero-gradient entries; see test_hf_layouts.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.test_moe_layouts import launch, loads
from tests.helpers import scalars, tiny_args
from titanium.checkpoint.hf import HFCheckpoint

CONSTANT_LR = ("--lr_scheduler.warmup_steps", "0", "--lr_scheduler.min_lr_factor", "1.0")
MODEL = ("--model.name", "qwen3_moe", "--model.flavor", "debugmodel_moe", "--data.kind", "synthetic")
BIAS = ("--moe.load_balance", "bias", "--moe.bias_update_rate", "0.01")
DP4 = ("--training.local_batch_size", "1")


def job(folder: Path, steps: int, *extra: str) -> list[str]:
    return tiny_args(folder, *MODEL, *CONSTANT_LR, "--training.steps", str(steps), *extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("moe_checkpoints")
    saved = ("--checkpoint.enable", "--checkpoint.interval", "4")
    step4 = (
        "--checkpoint.initial_load_path",
        str(root / "ep4/checkpoint/step-4"),
        "--checkpoint.no_initial_load_model_only",
    )
    export = ("--checkpoint.last_save_in_hf",)
    launch(1, [job(root / "single_export", 3, "--training.local_batch_size", "4", *export)])
    launch(
        4,
        [
            job(root / "ep4", 8, *DP4, *BIAS, *saved, "--parallelism.expert_parallel_degree", "4"),
            *[
                job(root / f"ep{ep}_resumed", 8, *DP4, *BIAS, *step4, "--parallelism.expert_parallel_degree", str(ep))
                for ep in (4, 2, 1)
            ],
            job(root / "ep4_export", 3, *DP4, *export, "--parallelism.expert_parallel_degree", "4"),
        ],
    )
    return root


@pytest.mark.parametrize("ep", [4, 2, 1])
def test_resume_at_another_expert_parallel_degree(runs, ep):
    expected, got = scalars(runs / "ep4/tb"), scalars(runs / f"ep{ep}_resumed/tb")
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-6 if ep == 4 else 1e-5), (step, got, expected)
    straight = loads(runs / "ep4")
    assert loads(runs / f"ep{ep}_resumed") == {step: straight[step] for step in (5, 6, 7, 8)}


def test_hf_export_from_expert_parallel_layout(runs):
    ref, got = HFCheckpoint.open(runs / "single_export/hf"), HFCheckpoint.open(runs / "ep4_export/hf")
    assert got.weight_map == ref.weight_map
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in got.shapes
    expected, actual = ref.read(), got.read()
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, atol=1e-6 if value.dim() == 1 else 2e-4, rtol=0, msg=key)
