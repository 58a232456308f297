"""DPO under FSDP, TP, CP and PP (and LoRA under FSDP) trains to the same numbers as one process (fp32, gloo).

5 steps of the debug model on the bundled preference pairs, 4 pairs per step, seq_len 64, starting from the
same seeded weights (the reference is the starting policy). Losses must agree to 1e-5 relative and grad norms
to 2e-4 (tests/distributed/parity.py says why), and the per-pair metrics the loop reduces over ranks
(chosen log-prob, margin, accuracy) must agree too.

- Padded pairs hold the same pairs per step at any data-parallel degree, so FSDP compares with them; packed
  rows (several pairs per row pair) are read whole by the TP, CP and PP runs and compared with packed rows.
- Shared-prompt rows (--dpo.share_prompt, the default: a pair's prompt once, then both responses) run under
  one process, FSDP, TP, CP and LoRA; PP keeps one row per sequence, so it compares with a one-process run
  of separate rows (packed differently: a shared row holds other pairs than a row pair). The one-process
  launch also trains separate padded rows, which must give what the shared rows give.
- The pipeline runs cut each microbatch into 1-pair pipeline microbatches (2 rows each): the loss of a slice
  needs only its own rows. Under CP every shared row is split over the two ranks (the parent-document mask
  in chunks), a label whose predicting column lies on the other rank is taken from the gathered hidden
  states, and the log-prob sums are added over the cp group (differentiably) before the sigmoid: the grad
  norms check that backward.
- FSDP and PP also run with precomputed reference log-probs (the pass split over data-parallel ranks, and
  under PP computed on the last stage only, then gathered): training on the cache must give what the online
  reference gives, within the same tolerances.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.parity import STEPS, Run, assert_matches, layout_runs
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
SEPARATE = ("--dpo.no_share_prompt",)
PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B")
METRICS = ("dpo/logp_chosen", "dpo/margin", "dpo/accuracy")

DPORun = tuple[Run, dict[str, dict[int, float]]]


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> str:
    lines = (REPO / "assets/tasks/arithmetic/preference_train.jsonl").read_text().splitlines(keepends=True)
    path = tmp_path_factory.mktemp("dpo_data") / "pairs.jsonl"
    path.write_text("".join(lines[:PAIRS]))
    return str(path)


LAYOUTS = {
    "fsdp2_cached": ("padded", ("--training.local_batch_size", "2", *CACHED)),
    "tp2": ("packed", (*PACKED, "--parallelism.tensor_parallel_degree", "2")),
    "cp2": ("packed", (*PACKED, "--parallelism.context_parallel_degree", "2")),
    "pp2_cached": ("packed_separate", (*PACKED, *PP2, *CACHED)),
    "lora_fsdp2": ("lora", (*LORA, "--training.local_batch_size", "2")),
}
"""Two-process layout -> (the one-process run it is compared with, its arguments)."""
SINGLE = {
    "padded": (),
    "packed": PACKED,
    "lora": LORA,
    "packed_separate": (*PACKED, *SEPARATE),
    "padded_separate": SEPARATE,
}


def dpo_runs(folder: Path, pairs_file: str, nproc: int, jobs: dict[str, tuple[str, ...]]) -> dict[str, DPORun]:
    """All ``jobs`` in one launch of ``nproc`` processes: (losses, grad norms) and the DPO metrics of each."""
    runs = layout_runs(folder, nproc, jobs, data=(*DPO, "--data.path", pairs_file))
    return {name: (run, {m: scalars(folder / name / "tb", m) for m in METRICS}) for name, run in runs.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pairs_file) -> dict[str, DPORun]:
    """Every layout (one launch of 2 processes) and the one-process runs (one launch), made once."""
    folder = tmp_path_factory.mktemp("dpo_layouts")
    layouts = dpo_runs(folder, pairs_file, 2, {name: extra for name, (_, extra) in LAYOUTS.items()})
    singles = dpo_runs(folder, pairs_file, 1, {f"single_{kind}": extra for kind, extra in SINGLE.items()})
    return {**layouts, **singles}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dpo_layouts_match_one_process(runs, name):
    assert_same_training(runs[name], runs[f"single_{LAYOUTS[name][0]}"])


def test_shared_prompt_rows_train_as_separate_rows(runs):
    assert_same_training(runs["single_padded_separate"], runs["single_padded"])


def assert_same_training(got: DPORun, want: DPORun) -> None:
    """Losses, grad norms and the DPO metrics of every step agree (the tolerances of the module docstring)."""
    (run, metrics), (reference, reference_metrics) = got, want
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
