"""Guards and validation under FSDP, PP and CP (gloo) match one process.

Every run trains the debug model 5 steps with the NanLoss objective (tests/objectives/faults.py: step 3's loss is
NaN on data-parallel rank 0 only, its gradients finite) under --guards.on_nonfinite skip, and validates every 2
steps on 2 held-out microbatches. All ranks must skip step 3 (the other ranks' own losses are finite), so the later
losses and grad norms equal one process's (rel 1e-5 and 2e-4, as in parity.py), and so must the validation losses
(rel 1e-5): under PP they come from the training schedule run forward only, under CP from sequence shards.
PP and CP keep one data-parallel rank, so they read the bundled text exactly as one process does; FSDP splits the
data over its ranks, so it is compared on synthetic windows, which are the same for every layout.
"""

from __future__ import annotations

import math

import pytest

from tests.distributed.parity import STEPS, layout_run
from tests.helpers import scalars

GUARDED = (
    "--training.objective", "tests.objectives.faults:NanLoss", "--guards.on_nonfinite", "skip",
    "--validation.interval", "2", "--validation.steps", "2",
)  # fmt: skip
TEXT = ("--data.kind", "text")
PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B")
CP2 = ("--parallelism.context_parallel_degree", "2")


def _run(tmp_path, name, nproc, *extra, data):
    losses, norms = layout_run(tmp_path, name, nproc, *GUARDED, *extra, data=data)
    tb = tmp_path / name / "tb"
    return losses, norms, scalars(tb, "validation/loss"), scalars(tb, "guards/skipped_steps")


def _assert_matches(run, reference):
    (losses, norms, validation, skipped), (ref_losses, ref_norms, ref_validation, ref_skipped) = run, reference
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert math.isnan(losses[3]) and math.isnan(ref_losses[3])
    for step in (1, 2, 4, 5):
        assert losses[step] == pytest.approx(ref_losses[step], rel=1e-5), (step, losses, ref_losses)
    for step in norms:
        assert norms[step] == pytest.approx(ref_norms[step], rel=2e-4), (step, norms, ref_norms)
    assert sorted(validation) == [2, 4, 5]
    for step in validation:
        assert validation[step] == pytest.approx(ref_validation[step], rel=1e-5), (step, validation, ref_validation)
    assert skipped == ref_skipped == {3: 1.0, 4: 1.0, 5: 1.0}


@pytest.fixture(scope="module")
def text_reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("text_ref"), "single", 1, data=TEXT)


@pytest.mark.parametrize("name, extra", [("pp2", PP2), ("cp2", CP2)])
def test_pipeline_and_context_parallel_match_one_process(tmp_path, text_reference, name, extra):
    _assert_matches(_run(tmp_path, name, 2, *extra, data=TEXT), text_reference)


def test_fsdp_matches_one_process(tmp_path):
    synthetic = ("--data.kind", "synthetic")
    reference = _run(tmp_path, "single", 1, data=synthetic)
    _assert_matches(_run(tmp_path, "fsdp2", 2, "--training.local_batch_size", "2", data=synthetic), reference)
