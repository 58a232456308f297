"""The kto objective under FSDP, PP, TP, CP and LoRA trains to the same numbers as one process (fp32, gloo).

5 steps of the debug model, 4 examples per step, from the same seeded weights (the reference is the starting
policy), on unpaired rows derived from the bundled preference pairs (each pair: its chosen answer desirable, its
rejected one not). Losses must agree to 1e-5 relative and grad norms to 2e-4 (tests/distributed/parity.py says
why), and so must the metrics the loop reduces over ranks (the KL estimate, the chosen rewards and log-probs).

- FSDP: two data-parallel ranks of 2 examples each read the file's 2 byte ranges, as one process does in turn.
  The KL point z0 is the mean over the step's mismatched rows of both ranks (one all-reduce in ``prepare``).
  Each rank pairs its own examples' prompts and completions (as each TRL process does), so one process with 4
  examples per microbatch pairs them differently; the rows here all share one prompt, which makes the step's
  set of mismatched rows the same in both layouts, and so z0 (the pairing itself is checked against TRL in
  tests/unit/test_kto_objective.py).
- PP: 1F1B over 2 stages, pipeline microbatches of 2 rows; the policy's no-grad forward of the mismatched rows
  runs through the pipeline too.
- TP 2: the training log-probs come from vocabulary-sharded logits (loss parallel), the prepare phase's from
  whole ones.
- CP 2: each rank sums the log-probs of its head-tail half of every row (training and mismatched rows, policy and
  reference), completed over the pair of ranks before the loss and the KL estimate.
- LoRA under FSDP 2 against LoRA in one process: the reference is the policy with its adapters switched off.

Each process count is one launch (tests/distributed/jobs_worker.py).
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.parity import STEPS, assert_matches, assert_metrics_match, layout_runs
from tests.helpers import REPO, scalars

PAIRS = 32
METRICS = ("kto/kl", "kto/reward_chosen", "kto/logp_chosen", "kto/logp_rejected")
LORA = ("--lora.rank", "4", "--lora.target_modules", "wq", "wv", "w2")
PP2 = (
    "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
    "--parallelism.pipeline_parallel_microbatch_size", "2",
)  # fmt: skip


def test_kto_fsdp_pp_tp_and_cp_match_one_process(tmp_path):
    lines = (REPO / "assets/tasks/arithmetic/preference_train.jsonl").read_text().splitlines()[:PAIRS]
    pairs = [json.loads(line) for line in lines]
    prompt = pairs[0]["prompt"]
    rows = [
        {"prompt": prompt, "completion": pair[side], "label": side == "chosen"}
        for pair in pairs
        for side in ("chosen", "rejected")
    ]
    data = tmp_path / "unpaired.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = (
        "--training.objective", "kto", "--data.kind", "unpaired", "--data.path", str(data),
        "--data.shards", "2", "--chat.chat_template", "llama3", "--kto.beta", "0.5",
        "--kto.desirable_weight", "1.2", "--optimizer.lr", "1e-3",
    )  # fmt: skip
    singles = layout_runs(tmp_path, 1, {"single": (), "single_lora": LORA}, *common)
    fsdp2 = ("--training.local_batch_size", "2")
    runs = layout_runs(
        tmp_path,
        2,
        {
            "fsdp2": fsdp2,
            "pp2": PP2,
            "tp2": ("--parallelism.tensor_parallel_degree", "2"),
            "cp2": ("--parallelism.context_parallel_degree", "2"),
            "lora_fsdp2": (*LORA, *fsdp2),
        },
        *common,
    )
    for single in singles.values():
        assert single[0][STEPS] != pytest.approx(single[0][1], rel=1e-3)  # it trains
    assert scalars(tmp_path / "single" / "tb", "kto/kl")[STEPS] > 0  # z0 is not the clamped 0 of step 1
    for name, run in runs.items():
        reference = "single_lora" if name.startswith("lora") else "single"
        assert_matches(run, singles[reference])
        assert_metrics_match(tmp_path / name, METRICS, tmp_path / reference)
