"""GRPO under FSDP on gloo: 2 processes train exactly as one process does, given the same rollouts; and
rollouts sampled from the live, sharded policy.

The layout runs (tests/objectives/fixed_rollouts.py) replace sampling by responses fixed in advance (sampling
draws differ between layouts); the rest is the real objective. Each step trains on 16 responses (4 prompts x
group 4) in 2 microbatches; every rollout batch serves 2 minibatches. Per-step losses must agree to 1e-5
relative and grad norms to 2e-4 (tests/distributed/parity.py says why), and the reduced metrics to 1e-5.
Two configurations cover the options: token aggregation with a KL-penalized frozen reference, batch-scaled
rewards, 2 PPO epochs and a tight clip (so tokens get clipped); sequence aggregation with truncated responses
masked and a policy lag of 1.
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import STEPS, assert_matches, layout_run
from tests.helpers import run_train, scalars, tiny_args

GRPO = (
    "--training.objective", "grpo",
    "--data.kind", "chat", "--data.path", "assets/tasks/arithmetic/train.jsonl",
    "--chat.chat_template", "llama3",
    "--data.shards", "2",  # one process reads the file's 2 byte ranges in turn, 2 DP ranks one each: same prompts
    "--grpo.group_size", "4", "--grpo.max_new_tokens", "8", "--grpo.max_prompt_len", "40",
    "--grpo.minibatches", "2",
    "--training.global_batch_size", "16",
    "--optimizer.lr", "3e-4",
)  # fmt: skip
FIXED = ("--grpo.rewards", "tests.objectives.fixed_rollouts:characters")
CONFIGS = {
    "kl_batch_epochs": (
        "--grpo.beta", "0.05", "--grpo.scale_rewards", "batch", "--grpo.ppo_epochs", "2",
        "--grpo.epsilon_low", "0.01", "--grpo.epsilon_high", "0.01",
    ),
    "sequence_masked_lag": (
        "--grpo.loss_type", "grpo", "--grpo.mask_truncated", "--grpo.max_policy_lag", "1",
    ),
}  # fmt: skip
METRICS = ("grpo/reward", "grpo/reward_std", "grpo/response_len", "grpo/entropy", "grpo/clip_frac", "grpo/policy_lag")
LAYOUTS = {"single": (1, "8"), "fsdp2": (2, "4")}  # processes, responses per microbatch


def _run(tmp_path, config: str, layout: str):
    nproc, local_batch = LAYOUTS[layout]
    name = f"{config}_{layout}"
    extra = (*GRPO, *FIXED, *CONFIGS[config], "--training.local_batch_size", local_batch)
    run = layout_run(tmp_path, name, nproc, *extra, data=(), module="tests.objectives.fixed_rollouts")
    metrics = METRICS + (("grpo/kl",) if config == "kl_batch_epochs" else ())
    return run, {tag: scalars(tmp_path / name / "tb", tag) for tag in metrics}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_fsdp_grpo_step_equals_one_process(tmp_path, config) -> None:
    (run, metrics), (ref_run, ref_metrics) = _run(tmp_path, config, "fsdp2"), _run(tmp_path, config, "single")
    assert_matches(run, ref_run)
    for tag, values in metrics.items():
        assert sorted(values) == list(range(1, STEPS + 1)), tag
        for step, value in values.items():
            assert value == pytest.approx(ref_metrics[tag][step], rel=1e-5, abs=1e-7), (tag, step, values)
    if config == "kl_batch_epochs":
        assert max(metrics["grpo/clip_frac"].values()) > 0 and max(metrics["grpo/kl"].values()) > 0
    else:
        assert metrics["grpo/policy_lag"][3] == 1  # the batch made at step 2 is first trained on at step 3
    losses = run[0]
    assert len(set(losses.values())) == STEPS  # it trains (each step a different loss)


def test_fsdp_rollouts_from_the_live_sharded_policy(tmp_path) -> None:
    """Real sampling under FSDP: every rank generates its own prompts' responses from the sharded policy
    (generation is a collective: the ranks step together until all are done), 2 steps."""
    out = tmp_path / "sampled"
    args = tiny_args(out, *GRPO, "--training.steps", "2", "--training.local_batch_size", "4")
    run_train([*args, "--grpo.rewards", "tests.objectives.fixed_rollouts:characters"], nproc=2)
    lengths = scalars(out / "tb", "grpo/response_len")
    speed = scalars(out / "tb", "grpo/gen_tokens_per_s")
    assert sorted(lengths) == [1, 2] and all(0 < n <= 8 for n in lengths.values())
    assert speed[1] > 0  # generated at step 1 (the batch serves steps 1 and 2)
