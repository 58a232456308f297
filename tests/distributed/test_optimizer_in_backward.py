"""Optimizer-in-backward under FSDP2 on 2 gloo processes: FSDP calls the post-accumulate-grad hooks of the
sharded parameters after it reduce-scatters their gradients, and each hook steps its shard.

The run matches one process of the same schedule (warmup then cosine decay) to float32 rounding, losses to
1e-5 relative as in parity.py, and its sharded checkpoint resumes to the uninterrupted losses (same layout:
a data position belongs to one data-parallel degree).
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import STEPS, layout_run
from tests.helpers import run_train, scalars, tiny_args

IN_BACKWARD = (
    "--optimizer.early_step_in_backward", "--training.max_norm", "0",
    "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_type", "cosine",
)  # fmt: skip
FSDP2 = ("--training.local_batch_size", "2")


def test_in_backward_under_fsdp_matches_one_process_and_resumes(tmp_path):
    checkpoints = ("--checkpoint.enable", "--checkpoint.interval", "3", "--debug.deterministic")
    fsdp_losses, fsdp_norms = layout_run(tmp_path, "fsdp2", 2, *FSDP2, *IN_BACKWARD, *checkpoints)
    single_losses, _ = layout_run(tmp_path, "single", 1, "--training.local_batch_size", "4", *IN_BACKWARD)
    assert sorted(fsdp_losses) == list(range(1, STEPS + 1))
    assert len({round(v, 4) for v in fsdp_losses.values()}) == STEPS  # training moves
    for step, loss in fsdp_losses.items():
        assert loss == pytest.approx(single_losses[step], rel=1e-5), (step, fsdp_losses, single_losses)
    assert set(fsdp_norms.values()) == {0.0}  # the gradients were freed inside backward

    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    (tmp_path / "fsdp2/checkpoint/step-3").rename(resumed / "checkpoint/step-3")
    args = tiny_args(resumed, "--data.kind", "synthetic", "--training.steps", str(STEPS), *FSDP2, *IN_BACKWARD)
    result = run_train([*args, *checkpoints], nproc=2)
    assert "resuming at step 3" in result.stderr
    got = scalars(resumed / "tb")
    assert sorted(got) == list(range(4, STEPS + 1))
    for step, loss in got.items():  # same layout, same order of operations: bitwise
        assert loss == fsdp_losses[step], (step, got, fsdp_losses)
