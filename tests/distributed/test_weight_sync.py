"""Weight sync into a rollout engine from every training layout equals the trainer's own export, bitwise.

``tests/objectives/synced_engine.py`` trains the debug model 3 steps (fp32, lr 1e-2 so each step moves every
weight) and syncs a titanium engine on every rank after every optimizer step, as the loop's after-step hook will.
At the end each rank's engine must hold exactly the weights of the run's Hugging Face export
(``--checkpoint.last_save_in_hf``, LoRA merged; itself checked against one process by test_pp_hf_export.py and
test_hf_fsdp.py): bitwise, on every rank. A sync that was skipped, stale or went to the wrong block would hold a
step's update too little (checked by hand: with the last sync skipped, the fsdp2 case fails).
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import layout_run
from tests.objectives.synced_engine import assert_engines_hold_the_export

ENGINE = "tests.objectives.synced_engine"
COMMON = ("--checkpoint.last_save_in_hf", "--optimizer.lr", "1e-2", "--training.steps", "3")
LORA = ("--lora.rank", "4", "--lora.target_modules", "wq", "wv", "w2", "output")
LAYOUTS = {
    "single": (1, ()),
    "fsdp2_float8_all_gather": (
        2,
        ("--training.local_batch_size", "2", "--float8.enable", "--float8.emulate",
         "--float8.enable_fsdp_float8_all_gather"),
    ),
    "tp2": (2, ("--parallelism.tensor_parallel_degree", "2")),
    "pp2_lora_qat": (2, ("--parallelism.pipeline_parallel_degree", "2", "--qat.enable", *LORA)),
}  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_holds_the_trained_weights_of_every_layout(tmp_path, layout) -> None:
    nproc, extra = LAYOUTS[layout]
    layout_run(tmp_path, layout, nproc, *COMMON, *extra, module=ENGINE)
    assert_engines_hold_the_export(tmp_path / layout, nproc, version=3)
