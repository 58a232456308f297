"""The default bf16 mixed precision, numerically: FSDP (which casts the parameters) and one process (which
autocasts) agree, and both really compute in bf16.

bf16 keeps 8 bits of mantissa, so layouts that reduce in a different order drift apart by more than the
fp32 parity tolerance: over 5 steps the losses agree to 1e-3 relative and the grad norms to 1e-2 (measured on
the debug model: at most 3e-4 and 2e-3). Both differ from the fp32 run (the configured dtype applies in every
layout) while staying within 1e-3 of it.
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import STEPS, layout_run

BF16 = ("--training.mixed_precision_param", "bfloat16")


def test_bf16_fsdp_matches_bf16_one_process_and_both_are_bf16(tmp_path, single_process_reference):
    one_losses, one_norms = layout_run(tmp_path, "bf16_single", 1, *BF16, "--training.local_batch_size", "4")
    fsdp_losses, fsdp_norms = layout_run(tmp_path, "bf16_fsdp2", 2, *BF16, "--training.local_batch_size", "2")
    fp32_losses, _ = single_process_reference
    assert sorted(one_losses) == sorted(fsdp_losses) == list(range(1, STEPS + 1))
    for step in one_losses:
        assert fsdp_losses[step] == pytest.approx(one_losses[step], rel=1e-3), (step, fsdp_losses, one_losses)
        assert fsdp_norms[step] == pytest.approx(one_norms[step], rel=1e-2), (step, fsdp_norms, one_norms)
        for losses in (one_losses, fsdp_losses):
            assert losses[step] == pytest.approx(fp32_losses[step], rel=1e-3)
    for losses in (one_losses, fsdp_losses):  # not fp32 in disguise
        assert any(losses[s] != pytest.approx(fp32_losses[s], rel=1e-6) for s in losses), (losses, fp32_losses)
