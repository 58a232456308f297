"""SFT under each parallelism trains to the same numbers as one process (fp32, gloo, 5 steps).

Data is the bundled chat task, sequences 64 tokens, 4 per step. Tolerances as in test_fsdp_parity.py:
losses rel 1e-5, grad norms rel 2e-4.

- Packed rows (documents masked apart, positions restarting) under TP 2, CP 2 and PP 2: these layouts
  read the same rows as one process, so they must match it step by step.
- Under FSDP each data-parallel rank packs its own share of the samples, so packed rows differ from one
  process's; padded rows (one sample per row) hold the same samples per step at any DP degree, so the
  FSDP comparison uses them. That packing leaves a sample's loss unchanged is shown in
  tests/unit/test_sft_objective.py. LoRA (only the adapters train) is checked with DoRA and rsLoRA, a
  superset of plain LoRA's path (plain LoRA under FSDP: test_dpo_parity.py), under FSDP (magnitudes
  initialized from sharded weights), PP and CP on padded rows, and with an NF4 base (QDoRA) under FSDP;
  one FSDP run also evaluates (generates) every 2 steps, which must not change training.
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import Run, assert_matches, layout_runs

SFT = (
    "--training.objective", "sft",
    "--data.kind", "chat",
    "--data.path", "assets/tasks/arithmetic/train.jsonl",
    "--chat.chat_template", "llama3",
    "--optimizer.lr", "1e-3",
    "--data.shards", "2",  # one process reads the file's 2 byte ranges in turn, 2 DP ranks one each: same rows
)  # fmt: skip
PADDED = ("--sft.no_packing",)
LORA = ("--lora.rank", "4", "--lora.target_modules", "wq", "wv", "w2", "--lora.use_dora", "--lora.use_rslora")
ADAPTERS = {"full": (), "dora": LORA, "qdora": (*LORA, "--lora.quantize_base", "nf4")}
FSDP2 = ("--training.local_batch_size", "2")


PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B")
CP2 = ("--parallelism.context_parallel_degree", "2")
PACKED = {"tp2": ("--parallelism.tensor_parallel_degree", "2"), "cp2": CP2, "pp2": PP2}
"""name: flags of each layout on packed rows (2 processes)."""
PADDED_LAYOUTS = {
    # Evaluation (generation on both FSDP ranks) between steps must leave training untouched.
    "full_fsdp2_eval": (
        "full", (*FSDP2, "--eval.interval", "2", "--eval.max_samples", "8", "--eval.batch_size", "2"),
    ),
    "dora_fsdp2": ("dora", FSDP2),
    "dora_pp2": ("dora", PP2),
    "dora_cp2": ("dora", CP2),
    "qdora_fsdp2": ("qdora", FSDP2),  # NF4 base quantized before sharding: the same weights as one process
}  # fmt: skip
"""name: (what trains, flags) of each layout on padded rows (2 processes)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    """Every layout in one launch of 2 processes, and the one-process references (packed; padded full, DoRA and
    QDoRA) in one launch of 1: two torchrun starts for the lot."""
    folder = tmp_path_factory.mktemp("sft")
    singles = {"single_packed": (), **{f"single_{kind}": (*PADDED, *flags) for kind, flags in ADAPTERS.items()}}
    layouts = {
        **{f"packed_{name}": flags for name, flags in PACKED.items()},
        **{f"padded_{name}": (*PADDED, *ADAPTERS[kind], *flags) for name, (kind, flags) in PADDED_LAYOUTS.items()},
    }
    return {**layout_runs(folder, 1, singles, data=SFT), **layout_runs(folder, 2, layouts, data=SFT)}


@pytest.mark.parametrize("name", list(PACKED))
def test_packed_sft_layouts_match_one_process(runs, name):
    assert_matches(runs[f"packed_{name}"], runs["single_packed"])


@pytest.mark.parametrize("name", list(PADDED_LAYOUTS))
def test_padded_sft_layouts_match_one_process(runs, name):
    assert_matches(runs[f"padded_{name}"], runs[f"single_{PADDED_LAYOUTS[name][0]}"])
