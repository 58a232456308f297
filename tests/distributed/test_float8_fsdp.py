"""Emulated float8 training under FSDP, TP and PP on gloo, against the float32 single-process run.

Float8 rounds every matmul input (e4m3, 3 mantissa bits) and gradient, so losses cannot match the float32
run to rounding: over these 5 steps they stay within 1e-3 relative and grad norms within 5e-3 (measured:
3e-5 and 4e-4), and they must differ from it (the rounding really happens). FSDP's float8 all-gather casts
each weight shard with the scale of the whole weight (precomputed after the optimizer step), so it computes
exactly what casting the gathered weight does: equal to FSDP without it, to float32 rounding.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.parity import Run, layout_runs

FLOAT8 = ("--float8.enable", "--float8.emulate")
FSDP2 = ("--training.local_batch_size", "2")
TP2 = ("--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2")
PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B")


def assert_close_not_equal(run: Run, reference: Run) -> None:
    (losses, norms), (ref_losses, ref_norms) = run, reference
    assert sorted(losses) == sorted(ref_losses)
    assert losses != ref_losses
    for step in losses:
        assert losses[step] == pytest.approx(ref_losses[step], rel=1e-3), (step, losses, ref_losses)
        assert norms[step] == pytest.approx(ref_norms[step], rel=5e-3), (step, norms, ref_norms)


LAYOUTS = {
    "fsdp2_float8_all_gather": (
        *FSDP2,
        "--float8.enable_fsdp_float8_all_gather",
        "--float8.precompute_float8_dynamic_scale_for_fsdp",
        "--checkpoint.enable",
    ),
    "fsdp2_float8": FSDP2,
    # rowwise scaling with the weight gradient in high precision, under per-op activation checkpointing
    "fsdp2_rowwise_gw_hp_sac": (
        *FSDP2,
        "--float8.recipe",
        "rowwise_with_gw_hp",
        "--activation_checkpoint.mode",
        "selective",
    ),
    # on gloo the float8 layers use torch's TP styles (see models/common/parallelize.py)
    "tp2_tensorwise": TP2,
    "pp2_1f1b": ("--training.local_batch_size", "4", *PP2),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, Run]]:
    """Every float8 layout, 2 processes, in one launch."""
    folder = tmp_path_factory.mktemp("float8")
    return folder, layout_runs(folder, 2, LAYOUTS, *FLOAT8)


def test_float8_all_gather_under_fsdp(runs, single_process_reference):
    """Also: its checkpoint holds plain weights, not torchao's float8 all-gather wrapper (which would not
    unpickle without torchao's allowlist, e.g. when resuming without float8)."""
    folder, runs = runs
    all_gather = runs["fsdp2_float8_all_gather"]
    assert_close_not_equal(all_gather, single_process_reference)
    files = list((folder / "fsdp2_float8_all_gather/checkpoint/step-5").glob("*.distcp"))
    assert files and not any(b"WeightWithDynamicFloat8CastTensor" in f.read_bytes() for f in files)
    for gathered, cast_after in zip(all_gather, runs["fsdp2_float8"]):
        assert gathered == pytest.approx(cast_after, rel=1e-6)


@pytest.mark.parametrize("name", ["fsdp2_rowwise_gw_hp_sac", "tp2_tensorwise", "pp2_1f1b"])
def test_float8_layouts_train_close_to_float32(runs, single_process_reference, name):
    assert_close_not_equal(runs[1][name], single_process_reference)
