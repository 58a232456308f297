"""Hugging Face weights load into a tensor-parallel layout, train like one process, and export back.

Qwen3 from a transformers checkpoint, trained 3 steps at TP 2 against one process on the same
synthetic data; this also checks Qwen3's TP plan, where the per-head q/k norms see only their rank's
heads and their gradients must be summed over the TP group. Losses agree to 1e-5 relative (fp32
reduction order). Exported norm weights agree to 1e-6; matrices to 2e-4, because Adam turns
rounding-level gradient differences on near-zero-gradient elements into updates of up to lr (3e-3)
on a handful of entries (a missing reduction would show as lr-sized differences on every norm).
"""

from __future__ import annotations

import pytest
import torch

from tests.e2e.test_hf_train import make_hf_debug_checkpoint
from tests.helpers import run_train, scalars, tiny_args
from titanium.checkpoint.hf import HFCheckpoint

pytest.importorskip("transformers")
STEPS = 3


def hf_run(tmp_path, source, name: str, nproc: int, *extra: str) -> tuple[dict, dict]:
    out = tmp_path / name
    args = tiny_args(
        out, "--model.name", "qwen3", "--data.kind", "synthetic", "--training.steps", str(STEPS),
        "--training.local_batch_size", "4", "--checkpoint.initial_load_path", str(source),
        "--checkpoint.initial_load_in_hf", "--checkpoint.last_save_in_hf", *extra,
    )  # fmt: skip
    run_train(args, nproc=nproc)
    return scalars(out / "tb"), HFCheckpoint.open(out / "hf").read()


def test_tensor_parallel_matches_single_process(tmp_path) -> None:
    source = tmp_path / "source"
    make_hf_debug_checkpoint(source, "qwen3")
    ref_losses, ref_weights = hf_run(tmp_path, source, "single", 1)
    losses, weights = hf_run(tmp_path, source, "tp2", 2, "--parallelism.tensor_parallel_degree", "2")
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step in losses:
        assert losses[step] == pytest.approx(ref_losses[step], rel=1e-5), (step, losses, ref_losses)
    assert set(weights) == set(ref_weights)
    for key, value in ref_weights.items():
        atol = 1e-6 if value.dim() == 1 else 2e-4
        torch.testing.assert_close(weights[key], value, atol=atol, rtol=0, msg=key)
