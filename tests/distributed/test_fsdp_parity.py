"""FSDP and HSDP over gloo processes train to the same numbers as one process (fp32).

The synthetic data is layout-invariant (see SyntheticDataset), and a sharded model is initialized
from the same full weights as one process, so losses and grad norms must agree step by step up to
float32 reduction-order rounding: losses to 1e-5 relative.

Grad norms are compared to 2e-4: the gradients agree to 1e-6, but torch's float32 vector norm on
CPU loses ~8e-5 relative on the 577k-element output-layer gradient of one process (measured against
float64), and a different amount when the same gradient is split into shards.
"""

from __future__ import annotations

import pytest

from tests.helpers import run_train, scalars, tiny_args

STEPS = 5


def layout_run(tmp_path, name: str, nproc: int, *extra: str) -> tuple[dict, dict]:
    out = tmp_path / name
    args = tiny_args(out, "--data.kind", "synthetic", "--training.steps", str(STEPS), *extra)
    run_train(args, nproc=nproc)
    return scalars(out / "tb"), scalars(out / "tb", "optim/grad_norm")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return layout_run(tmp_path_factory.mktemp("ref"), "single", 1, "--training.local_batch_size", "4")


@pytest.mark.parametrize(
    "name, nproc, extra",
    [
        ("fsdp2", 2, ("--training.local_batch_size", "2")),
        ("fsdp2_accum", 2, ("--training.local_batch_size", "1", "--training.global_batch_size", "4")),
        ("hsdp2x2", 4, ("--training.local_batch_size", "1", "--parallelism.data_parallel_replicate_degree", "2")),
    ],
)
def test_data_parallel_matches_single_process(tmp_path, reference, name, nproc, extra):
    losses, norms = layout_run(tmp_path, name, nproc, *extra)
    ref_losses, ref_norms = reference
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step in losses:
        assert losses[step] == pytest.approx(ref_losses[step], rel=1e-5), (step, losses, ref_losses)
        assert norms[step] == pytest.approx(ref_norms[step], rel=2e-4), (step, norms, ref_norms)
