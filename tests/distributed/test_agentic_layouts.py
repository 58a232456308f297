"""GRPO on multi-turn episodes (holes in the loss mask where the environment spoke) under FSDP 2, TP 2 (the engine
split over the tp ranks) and CP 2 (each rank's part of every row, response log-probs completed over the group):
the same losses, grad norms and metrics as one process on the same episodes (tests/objectives/fixed_episodes.py).
One launch per process count; 5 steps each, 16 episodes a step in 2 microbatches, a policy lag of 1 with old
log-probs recomputed and importance weights, and a KL to the reference (so the masks reach every term). Tolerances
are parity.py's (grad norms 2e-4 relative, metrics 1e-5), the losses also 1e-6 absolute: a GRPO step's loss sits
near 0 (a group's advantages sum to 0), where float32 sums in another order differ by ~1e-7 (measured)."""

from __future__ import annotations

import pytest

from tests.distributed.parity import STEPS, layout_runs
from tests.helpers import scalars

AGENTIC = (
    "--training.objective", "grpo",
    "--data.kind", "chat", "--data.path", "assets/tasks/arithmetic/train.jsonl",
    "--chat.chat_template", "llama3", "--data.shards", "2",
    "--environment.name", "tests.objectives.fixed_episodes:Silent",
    "--grpo.group_size", "4", "--rl.max_new_tokens", "20", "--rl.max_prompt_len", "40",
    "--rl.rewards", "tests.objectives.fixed_rollouts:characters",
    "--grpo.minibatches", "2", "--training.global_batch_size", "16", "--optimizer.lr", "3e-4",
    "--grpo.beta", "0.05", "--grpo.epsilon_low", "0.01", "--grpo.epsilon_high", "0.01",
    "--rl.max_policy_lag", "1", "--grpo.old_logprobs", "recompute", "--grpo.is_correction", "token_truncate",
)  # fmt: skip
LAYOUTS = {
    "single": (1, ("--training.local_batch_size", "8")),
    "fsdp2": (2, ("--training.local_batch_size", "4")),
    "tp2": (2, ("--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2",
                "--rollout.tensor_parallel_size", "2")),
    "cp2": (2, ("--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2")),
}  # fmt: skip
METRICS = ("grpo/reward", "grpo/response_len", "grpo/entropy", "grpo/clip_frac", "grpo/kl", "grpo/env/turns")
METRICS += ("grpo/env/env_tokens", "grpo/truncated")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for nproc in (1, 2):
        tmp = tmp_path_factory.mktemp(f"agentic_{nproc}")
        jobs = {name: (*AGENTIC, *extra) for name, (n, extra) in LAYOUTS.items() if n == nproc}
        done = layout_runs(tmp, nproc, jobs, data=(), module="tests.objectives.fixed_episodes")
        out.update({name: (run, {m: scalars(tmp / name / "tb", m) for m in METRICS}) for name, run in done.items()})
    return out


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "cp2"])
def test_multi_turn_grpo_equals_one_process(runs, layout) -> None:
    ((losses, norms), metrics), ((ref_losses, ref_norms), ref_metrics) = runs[layout], runs["single"]
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in losses.items():
        assert loss == pytest.approx(ref_losses[step], rel=1e-5, abs=1e-6), (step, losses, ref_losses)
        assert norms[step] == pytest.approx(ref_norms[step], rel=2e-4), (step, norms, ref_norms)
    for name, values in metrics.items():
        assert sorted(values) == list(range(1, STEPS + 1)), name
        for step, value in values.items():
            assert value == pytest.approx(ref_metrics[name][step], rel=1e-5, abs=1e-7), (name, step)
    assert max(metrics["grpo/env/env_tokens"].values()) > 0 and max(metrics["grpo/clip_frac"].values()) > 0
    assert len(set(losses.values())) == STEPS  # (it trains)
