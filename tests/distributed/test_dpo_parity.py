"""DPO under FSDP, TP, CP and PP (and LoRA under FSDP) trains to the same numbers as one process (fp32, gloo).

5 steps of the debug model on the bundled preference pairs, 4 pairs per step, seq_len 64, starting from the
same seeded weights (the reference is the starting policy). Losses must agree to 1e-5 relative and grad norms
to 2e-4 (tests/distributed/parity.py says why), and the per-pair metrics the loop reduces over ranks
(chosen log-prob, margin, accuracy) must agree too.

- Padded pairs hold the same pairs per step at any data-parallel degree, so FSDP compares with them; packed
  rows (several pairs per row pair) are read whole by the TP, CP and PP runs and compared with packed rows.
- The pipeline runs cut each microbatch into 1-pair pipeline microbatches (2 rows each): the loss of a slice
  needs only its own rows. Under CP every response is split over the two ranks and its log-prob sums are
  added over the cp group (differentiably) before the sigmoid: the grad norms check that backward.
- FSDP and PP also run with precomputed reference log-probs (the pass split over data-parallel ranks, and
  under PP computed on the last stage only, then gathered): training on the cache must give what the online
  reference gives, within the same tolerances.
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import STEPS, Run, assert_matches, layout_run
from tests.helpers import REPO, scalars

DPO = (
    "--training.objective", "dpo", "--data.kind", "preference", "--chat.chat_template", "llama3",
    "--data.shards", "2",  # one process reads the file's 2 byte ranges in turn, 2 DP ranks one each: same pairs
)  # fmt: skip
PAIRS = 64
"""The first pairs of the bundled set (5 steps read 20; the precompute pass reads them all)."""
PACKED = ("--dpo.packing",)
LORA = ("--lora.rank", "4", "--lora.target_modules", "wq", "wv", "w2")
CACHED = ("--dpo.precompute_reference",)
PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B")
METRICS = ("dpo/logp_chosen", "dpo/margin", "dpo/accuracy")

DPORun = tuple[Run, dict[str, dict[int, float]]]


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> str:
    lines = (REPO / "assets/tasks/arithmetic/preference_train.jsonl").read_text().splitlines(keepends=True)
    path = tmp_path_factory.mktemp("dpo_data") / "pairs.jsonl"
    path.write_text("".join(lines[:PAIRS]))
    return str(path)


def dpo_run(tmp_path, pairs_file: str, name: str, nproc: int, *extra: str) -> DPORun:
    run = layout_run(tmp_path, name, nproc, *extra, data=(*DPO, "--data.path", pairs_file))
    return run, {m: scalars(tmp_path / name / "tb", m) for m in METRICS}


@pytest.fixture(scope="module")
def single(tmp_path_factory, pairs_file):
    """One-process runs (padded, packed, LoRA), each made once for the module."""
    folder, runs = tmp_path_factory.mktemp("dpo_single"), {}

    def get(kind: str) -> DPORun:
        if kind not in runs:
            extra = {"padded": (), "packed": PACKED, "lora": LORA}[kind]
            runs[kind] = dpo_run(folder, pairs_file, f"single_{kind}", 1, *extra)
        return runs[kind]

    return get


@pytest.mark.parametrize(
    "kind, name, extra",
    [
        ("padded", "fsdp2_cached", ("--training.local_batch_size", "2", *CACHED)),
        ("packed", "tp2", (*PACKED, "--parallelism.tensor_parallel_degree", "2")),
        ("packed", "cp2", (*PACKED, "--parallelism.context_parallel_degree", "2")),
        ("packed", "pp2_cached", (*PACKED, *PP2, *CACHED)),
        ("lora", "lora_fsdp2", (*LORA, "--training.local_batch_size", "2")),
    ],
)
def test_dpo_layouts_match_one_process(tmp_path, pairs_file, single, kind, name, extra):
    (run, metrics), (reference, reference_metrics) = dpo_run(tmp_path, pairs_file, name, 2, *extra), single(kind)
    assert_matches(run, reference)
    for metric, values in metrics.items():
        assert sorted(values) == list(range(1, STEPS + 1)), metric
        for step, value in values.items():
            expected = reference_metrics[metric][step]
            assert value == pytest.approx(expected, rel=1e-5, abs=1e-5), (
                metric,
                step,
                values,
                reference_metrics[metric],
            )
    losses = run[0]
    assert losses[1] == pytest.approx(0.6931472, rel=1e-6)  # the policy starts as the reference: log 2
    assert losses[STEPS] != pytest.approx(losses[1], rel=1e-4)  # it trains (LoRA from B = 0: slowly)
