"""The Hugging Face export of a pipeline-parallel run holds every stage and equals the one-process export.

Each case trains the debug model 2 steps (fp32, synthetic data) in one process and at PP 2 with
``--checkpoint.last_save_in_hf``, then compares the two ``hf/`` folders: the same keys, the same
config.json, and every tensor within 2e-5 absolute. Measured: at most 3.1e-6 (PP alone) and 6e-7 (LoRA,
merged). Adam turns rounding-level gradient differences into slightly different updates of a few
near-zero-gradient elements; a missing, stale or misplaced tensor differs by the size of a training
update (>= 1e-3) or of the weights themselves. The LoRA case also compiles the blocks: PP + compile on
CPU, whose losses must match the eager single process (rel 1e-5).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed.parity import layout_run
from titanium.checkpoint.hf import HFCheckpoint

PP2 = ("--parallelism.pipeline_parallel_degree", "2")
EXPORT = ("--checkpoint.last_save_in_hf", "--training.steps", "2")
LORA = ("--lora.rank", "4", "--lora.target_modules", "wq", "wv", "w2", "output", "--optimizer.lr", "1e-2")


@pytest.mark.parametrize(
    "name, extra, pp_extra",
    [
        ("full", (), ()),
        ("lora_compiled", LORA, ("--compile.enable",)),
    ],
)
def test_pipeline_hf_export_equals_single_process(tmp_path, name, extra, pp_extra):
    single_losses, _ = layout_run(tmp_path, "single", 1, *EXPORT, *extra)
    losses, _ = layout_run(tmp_path, "pp2", 2, *PP2, *EXPORT, *extra, *pp_extra)
    for step, loss in single_losses.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5), (step, losses, single_losses)
    ref, got = tmp_path / "single/hf", tmp_path / "pp2/hf"
    assert json.loads((got / "config.json").read_text()) == json.loads((ref / "config.json").read_text())
    ref_weights, weights = HFCheckpoint.open(ref).read(), HFCheckpoint.open(got).read()
    assert sorted(weights) == sorted(ref_weights)
    assert len(weights) == 57  # embedding, 6 x 9 per block, final norm, lm_head
    for key, value in ref_weights.items():
        torch.testing.assert_close(weights[key], value, atol=2e-5, rtol=0, msg=key)
