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
import torch
from safetensors import safe_open

from tests.distributed.parity import layout_run
from titanium.checkpoint.hf import HFCheckpoint
from titanium.models import get_model_spec

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


def engine_weights(folder, rank: int) -> tuple[dict[str, torch.Tensor], int]:
    with safe_open(str(folder / "engine" / f"rank{rank}.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, int(f.metadata()["version"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_holds_the_trained_weights_of_every_layout(tmp_path, layout) -> None:
    nproc, extra = LAYOUTS[layout]
    layout_run(tmp_path, layout, nproc, *COMMON, *extra, module=ENGINE)
    out = tmp_path / layout
    spec = get_model_spec("llama3")
    exported = HFCheckpoint.open(out / "hf").read()
    args = type("Args", (), {"tie_word_embeddings": False, "head_dim": 16})()  # (what from_hf reads)
    expected = spec.hf_adapter.from_hf(exported, args)
    first = None
    for rank in range(nproc):
        weights, version = engine_weights(out, rank)
        assert version == 3, (rank, version)  # synced after the last step
        assert sorted(weights) == sorted(expected), rank
        for key, value in expected.items():
            assert torch.equal(weights[key], value), (rank, key, (weights[key] - value).abs().max())
        logprobs = torch.load(out / "engine" / f"rank{rank}_logprobs.pt")
        first = logprobs if first is None else first
        assert torch.equal(logprobs, first), rank  # every rank generates from the same policy
