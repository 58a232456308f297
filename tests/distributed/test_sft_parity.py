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

from tests.distributed.parity import Run, assert_matches, layout_run

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


@pytest.fixture(scope="module")
def packed_reference(tmp_path_factory) -> Run:
    return layout_run(tmp_path_factory.mktemp("sft"), "single_packed", 1, data=SFT)


@pytest.mark.parametrize(
    "name, extra",
    [
        ("tp2", ("--parallelism.tensor_parallel_degree", "2")),
        ("cp2", ("--parallelism.context_parallel_degree", "2")),
        ("pp2", ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B")),
    ],
)
def test_packed_sft_layouts_match_one_process(tmp_path, packed_reference, name, extra):
    assert_matches(layout_run(tmp_path, name, 2, *extra, data=SFT), packed_reference)


@pytest.fixture(scope="module")
def padded_reference(tmp_path_factory):
    """One-process padded runs (full, DoRA, QDoRA), each made once for the module."""
    folder, runs = tmp_path_factory.mktemp("sft_padded"), {}

    def get(kind: str) -> Run:
        if kind not in runs:
            runs[kind] = layout_run(folder, f"single_{kind}", 1, *PADDED, *ADAPTERS[kind], data=SFT)
        return runs[kind]

    return get


@pytest.mark.parametrize(
    "kind, name, extra",
    [
        # Evaluation (generation on both FSDP ranks) between steps must leave training untouched.
        ("full", "fsdp2_eval", (*FSDP2, "--eval.interval", "2", "--eval.max_samples", "8", "--eval.batch_size", "2")),
        ("dora", "fsdp2", FSDP2),
        (
            "dora",
            "pp2",
            ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"),
        ),
        ("dora", "cp2", ("--parallelism.context_parallel_degree", "2")),
        ("qdora", "fsdp2", FSDP2),  # NF4 base quantized before sharding: the same weights as one process
    ],
)
def test_padded_sft_layouts_match_one_process(tmp_path, padded_reference, kind, name, extra):
    run = layout_run(tmp_path, name, 2, *PADDED, *ADAPTERS[kind], *extra, data=SFT)
    assert_matches(run, padded_reference(kind))
