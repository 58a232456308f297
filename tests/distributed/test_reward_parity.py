"""The reward objective under FSDP, TP, PP and CP trains to the same numbers as one process (fp32, gloo).

5 steps of the debug model as a reward model on the first pairs of the bundled preference set, 4 pairs per step,
from the same seeded weights. Losses must agree to 1e-5 relative and grad norms to 2e-4 (tests/distributed/parity.py
says why), and so must the per-pair metrics the loop reduces over ranks (accuracy, margin, chosen score).

- FSDP: two data-parallel ranks of 2 pairs each read the file's 2 byte ranges, as one process does in turn.
- TP: the body split by the family's plan, the one-output score head replicated on both ranks (each scores its
  sequence shard, the scores gathered whole).
- PP: 1F1B over 2 stages, pipeline microbatches of one pair (2 rows): each holds whole pairs, the last stage
  scores them.
- CP: each rank holds the head-tail half of every sequence; the score comes from the rank holding the sequence's
  last non-pad token (the other adds zero), summed over the pair of ranks before the loss.

Each process count is one launch (tests/distributed/jobs_worker.py).
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import STEPS, assert_matches, assert_metrics_match, layout_runs
from tests.helpers import REPO

PAIRS = 32
METRICS = ("reward/accuracy", "reward/margin", "reward/reward_chosen")
PP2 = (
    "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
    "--parallelism.pipeline_parallel_microbatch_size", "2",
)  # fmt: skip


def test_reward_fsdp_tp_pp_and_cp_match_one_process(tmp_path):
    lines = (REPO / "assets/tasks/arithmetic/preference_train.jsonl").read_text().splitlines(keepends=True)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(lines[:PAIRS]))
    common = (
        "--training.objective", "reward", "--data.kind", "preference", "--data.path", str(pairs),
        "--data.shards", "2", "--chat.chat_template", "llama3", "--reward.center_rewards_coefficient", "0.01",
        "--optimizer.lr", "1e-3",
    )  # fmt: skip
    single = layout_runs(tmp_path, 1, {"single": ()}, *common)["single"]
    jobs = {
        "fsdp2": ("--training.local_batch_size", "2"),
        "pp2": PP2,
        "tp2": ("--parallelism.tensor_parallel_degree", "2"),
        "cp2": ("--parallelism.context_parallel_degree", "2"),
    }
    runs = layout_runs(tmp_path, 2, jobs, *common)
    assert single[0][STEPS] != pytest.approx(single[0][1], rel=1e-3)  # it trains
    for name, run in runs.items():
        assert_matches(run, single)
        assert_metrics_match(tmp_path / name, METRICS, tmp_path / "single")
