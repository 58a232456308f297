"""The objective seams under FSDP, TP, PP and CP on gloo match one process (fp32, 5 steps).

The test objective (tests/objectives/reference.py) is given by import path and brings its own config section
([reference] penalty); it holds a frozen reference model handle, fills the reference's log-probs into a custom
batch field in the no-grad prepare phase, and returns (sum, count) metrics. Losses must agree to 1e-5 relative
and grad norms to 2e-4 (tests/distributed/parity.py says why), and the reference's mean NLL, reduced over ranks
by the loop, to 1e-5. Under PP its loss raises unless it gets every field of its microbatch's rows, so the
pipeline runs also check that the last stage sees the objective's whole microbatch; under CP each rank holds its
part of every sequence, custom per-token field included. With LoRA the reference is the policy itself with its
adapters off (no copy), under PP too.

Every job runs in one of two launches (tests/distributed/jobs_worker.py): the single-process references, and
every 2-process layout one after the other.
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import STEPS, Run, assert_matches, layout_runs
from tests.helpers import scalars

OBJECTIVE = ("--training.objective", "tests.objectives.reference:ReferenceObjective", "--reference.penalty", "5")
PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2")
LORA = ("--lora.rank", "4", "--lora.target_modules", "wq", "wv", "w2")
LAYOUTS = {
    "fsdp2": ("--training.local_batch_size", "2"),
    "tp2": ("--parallelism.tensor_parallel_degree", "2"),
    "pp2": PP2,
    "cp2": ("--parallelism.context_parallel_degree", "2"),
}
SINGLE = {"single": ("--training.local_batch_size", "4"), "lora_single": (*LORA, "--training.local_batch_size", "4")}
PARALLEL = {**LAYOUTS, "lora_pp2": (*LORA, *PP2)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Run, dict[int, float]]]:
    """name -> ((losses, grad norms), the reference's mean NLL) by step, of every job."""
    out = {}
    for nproc, jobs in ((1, SINGLE), (2, PARALLEL)):
        tmp = tmp_path_factory.mktemp(f"objective_{nproc}")
        for name, run in layout_runs(tmp, nproc, jobs, *OBJECTIVE).items():
            out[name] = (run, scalars(tmp / name / "tb", "test/ref_nll"))
    return out


@pytest.mark.parametrize("name", LAYOUTS)
def test_reference_objective_matches_single_process(runs, name):
    (run, ref_nll), (ref_run, ref_ref_nll) = runs[name], runs["single"]
    assert_matches(run, ref_run)
    assert sorted(ref_nll) == list(range(1, STEPS + 1))
    for step in ref_nll:
        assert ref_nll[step] == pytest.approx(ref_ref_nll[step], rel=1e-5), (step, ref_nll, ref_ref_nll)
    losses = run[0]
    assert losses[STEPS] != pytest.approx(losses[1], rel=1e-3)  # it trains


def test_reference_is_the_starting_policy(runs):
    """At step 1 policy == reference, so the penalty is 0 and the loss is the reference's NLL."""
    (losses, _), ref_nll = runs["single"]
    assert losses[1] == pytest.approx(ref_nll[1], rel=1e-6)


def test_lora_reference_is_the_policy_with_adapters_off_under_pp(runs):
    """With LoRA the reference is the policy itself, adapters off (no copy); under PP too."""
    (ref_run, ref_nll), (run, nll) = runs["lora_single"], runs["lora_pp2"]
    assert_matches(run, ref_run)
    for step in ref_nll:
        assert nll[step] == pytest.approx(ref_nll[step], rel=1e-5), (step, nll, ref_nll)
    # The adapters train, the base does not: the reference (the base) gives the same NLL on the same data as
    # a frozen copy would; at step 1 the adapted policy still equals it.
    assert run[0][1] == pytest.approx(nll[1], rel=1e-6)
