"""The objective and converter seams under FSDP, TP, PP and CP on gloo match one process (fp32, 5 steps).

The test objective (tests/objectives/reference.py) is given by import path and brings its own config section
([reference] penalty); it holds a frozen reference model handle, fills the reference's log-probs into a custom
batch field in the no-grad prepare phase, and returns (sum, count) metrics. Losses must agree to 1e-5 relative
and grad norms to 2e-4 (tests/distributed/parity.py says why), and the reference's mean NLL, reduced over ranks
by the loop, to 1e-5. Under PP its loss raises unless it gets every field of its microbatch's rows, so the
pipeline runs also check that the last stage sees the objective's whole microbatch; under CP each rank holds its
part of every sequence, custom per-token field included.

A test converter registered from outside titanium (tests/objectives/aux_loss.py) adds an auxiliary loss term in
every decoder block: under PP each stage adds its own, and the result matches one process.
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import STEPS, assert_matches, layout_run
from tests.helpers import scalars

OBJECTIVE = ("--training.objective", "tests.objectives.reference:ReferenceObjective", "--reference.penalty", "5")
PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2")
LAYOUTS = [
    ("fsdp2", 2, ("--training.local_batch_size", "2")),
    ("tp2", 2, ("--parallelism.tensor_parallel_degree", "2")),
    ("pp2", 2, PP2),
    ("cp2", 2, ("--parallelism.context_parallel_degree", "2")),
]


def _run(tmp_path, name, nproc, *extra):
    run = layout_run(tmp_path, name, nproc, *OBJECTIVE, *extra)
    out = tmp_path / name / "tb"
    return run, scalars(out, "test/ref_nll")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("objective_ref"), "single", 1, "--training.local_batch_size", "4")


@pytest.mark.parametrize("name, nproc, extra", LAYOUTS)
def test_reference_objective_matches_single_process(tmp_path, reference, name, nproc, extra):
    (run, ref_nll), (ref_run, ref_ref_nll) = _run(tmp_path, name, nproc, *extra), reference
    assert_matches(run, ref_run)
    assert sorted(ref_nll) == list(range(1, STEPS + 1))
    for step in ref_nll:
        assert ref_nll[step] == pytest.approx(ref_ref_nll[step], rel=1e-5), (step, ref_nll, ref_ref_nll)
    losses = run[0]
    assert losses[STEPS] != pytest.approx(losses[1], rel=1e-3)  # it trains


def test_reference_is_the_starting_policy(tmp_path, reference):
    """At step 1 policy == reference, so the penalty is 0 and the loss is the reference's NLL."""
    (losses, _), ref_nll = reference
    assert losses[1] == pytest.approx(ref_nll[1], rel=1e-6)


LORA = ("--lora.rank", "4", "--lora.target_modules", "wq", "wv", "w2")


def test_lora_reference_is_the_policy_with_adapters_off_under_pp(tmp_path):
    """With LoRA the reference is the policy itself, adapters off (no copy); under PP too."""
    (ref_run, ref_nll) = _run(tmp_path, "lora_single", 1, *LORA, "--training.local_batch_size", "4")
    (run, nll) = _run(tmp_path, "lora_pp2", 2, *LORA, *PP2)
    assert_matches(run, ref_run)
    for step in ref_nll:
        assert nll[step] == pytest.approx(ref_nll[step], rel=1e-5), (step, nll, ref_nll)
    # The adapters train, the base does not: the reference (the base) gives the same NLL on the same data as
    # a frozen copy would; at step 1 the adapted policy still equals it.
    assert run[0][1] == pytest.approx(nll[1], rel=1e-6)


def test_an_auxiliary_loss_from_every_pipeline_stage_matches_one_process(tmp_path):
    penalty, module = ("--activation_penalty.coef", "0.01"), "tests.objectives.aux_loss"
    one = layout_run(tmp_path, "aux_single", 1, *penalty, "--training.local_batch_size", "4", module=module)
    assert_matches(layout_run(tmp_path, "aux_pp2", 2, *penalty, *PP2, module=module), one)
