"""Pipeline parallelism: every torch schedule, and PP with FSDP and/or TP, trains to the same numbers as
one process (fp32, gloo). Tolerances as in test_fsdp_parity.py: losses rel 1e-5, grad norms rel 2e-4
(measured: losses 1.2e-7; grad norms 1e-7 with PP alone, 4-7e-5 with FSDP/TP shards).

The debug model has 6 blocks; 2 pp ranks hold 2 stages (single-stage schedules) or 4 stages (multi-stage,
two per rank) unless a case sets the split.
"""

from __future__ import annotations

import shutil

import pytest

from tests.distributed.parity import Run, assert_matches, layout_run, layout_runs
from tests.helpers import scalars

PP2 = ("--parallelism.pipeline_parallel_degree", "2")


def schedule(name: str) -> tuple[str, str]:
    return ("--parallelism.pipeline_parallel_schedule", name)


SCHEDULES = {  # name: flags beyond PP2, each case 2 processes
    # GPipe with 2 pipeline microbatches of 2 sequences, and gradient accumulation over 2 of those.
    "gpipe_accum": (
        *schedule("GPipe"), "--training.local_batch_size", "2", "--training.global_batch_size", "4",
        "--parallelism.pipeline_parallel_microbatch_size", "1",
    ),
    "1f1b_split_points": (*schedule("1F1B"), "--parallelism.pipeline_parallel_split_points", "layers.2"),
    "interleaved_1f1b_full_ac": (*schedule("Interleaved1F1B"), "--activation_checkpoint.mode", "full"),
    # 6 stages of 1 block, 3 per rank (looped placement).
    "looped_bfs_6_stages": (*schedule("LoopedBFS"), "--parallelism.pipeline_parallel_layers_per_stage", "1"),
    "interleaved_zero_bubble": schedule("InterleavedZeroBubble"),
    "zbv_zero_bubble": schedule("ZBVZeroBubble"),
    "dualpipev": schedule("DualPipeV"),
}  # fmt: skip


@pytest.fixture(scope="module")
def schedule_runs(tmp_path_factory) -> dict[str, Run]:
    """Every case of SCHEDULES, in one launch of 2 processes (one torchrun start for the lot)."""
    return layout_runs(tmp_path_factory.mktemp("schedules"), 2, SCHEDULES, *PP2)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_pipeline_schedules_match_single_process(schedule_runs, single_process_reference, name):
    assert_matches(schedule_runs[name], single_process_reference)


COMPOSED = {  # name: (processes, flags beyond PP2)
    "pp2_fsdp2": (4, (*schedule("Interleaved1F1B"), "--training.local_batch_size", "2")),
    "pp2_tp2": (4, (*schedule("1F1B"), "--parallelism.tensor_parallel_degree", "2")),
    "pp2_fsdp2_tp2": (
        8,
        (*schedule("Interleaved1F1B"), "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "2"),
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def composed_runs(tmp_path_factory) -> dict[str, Run]:
    """Every case of COMPOSED, one launch per process count (one torchrun start for the lot)."""
    folder, runs = tmp_path_factory.mktemp("composed"), {}
    for nproc in sorted({nproc for nproc, _ in COMPOSED.values()}):
        runs |= layout_runs(folder, nproc, {name: extra for name, (n, extra) in COMPOSED.items() if n == nproc}, *PP2)
    return runs


@pytest.mark.parametrize("name", list(COMPOSED))
def test_pipeline_composes_with_fsdp_and_tp(composed_runs, single_process_reference, name):
    assert_matches(composed_runs[name], single_process_reference)


def test_pipeline_checkpoint_resumes_exactly(tmp_path, single_process_reference):
    """Pipeline ranks hold different parameters: a DCP checkpoint of the stages resumes bit for bit."""
    extra = (*PP2, *schedule("Interleaved1F1B"), "--checkpoint.enable", "--checkpoint.interval", "3")
    assert_matches(layout_run(tmp_path, "pp2_ckpt", 2, *extra), single_process_reference)
    first = scalars(tmp_path / "pp2_ckpt" / "tb")
    shutil.rmtree(tmp_path / "pp2_ckpt" / "checkpoint" / "step-5")
    shutil.rmtree(tmp_path / "pp2_ckpt" / "tb")
    resumed, _ = layout_run(tmp_path, "pp2_ckpt", 2, *extra)  # resumes from step 3
    assert resumed == {4: first[4], 5: first[5]}
