"""TRL 1.16's reward-function contract, run on TRL's documented example rewards unchanged
(tests/objectives/trl_doc_rewards.py): the keyword arguments TRL passes (prompts, completions as messages after a
conversation, completion_ids, the rows' columns, trainer_state, log_extra, log_metric), None for "does not apply",
async functions, and TRL's signature rule checked when the set is built, not at step 1."""

from __future__ import annotations

import math

import pytest
import torch

from titanium.config.errors import ConfigError
from titanium.objectives.grpo import group_advantages
from titanium.rl.rewards.functions import RewardSet, TrainerState

DOC = "tests.objectives.trl_doc_rewards"
PROMPTS = ["Problem: Solve the equation $2x + 3 = 7$. Solution:", "Problem: Solve the equation $3x - 5 = 10$."]
COMPLETIONS = [r" The solution is \boxed{2}.", r" The solution is \boxed{6}."]
ROWS = [{"prompt": PROMPTS[0], "ground_truth": "2"}, {"prompt": PROMPTS[1], "ground_truth": "5"}]


def _set(*names: str, columns=("prompt", "ground_truth")) -> RewardSet:
    return RewardSet([f"{DOC}:{name}" for name in names], columns=columns)


def _bound(rewards: RewardSet, prompts=PROMPTS, completion_ids=((1, 2), (3, 4, 5, 6)), step=3) -> RewardSet:
    return rewards.with_tokens([[0]] * len(prompts), completion_ids, list(prompts), TrainerState(step, 10))


def test_standard_examples_give_the_documented_values():
    rewards = _bound(_set("reward_len", "reward_func_characters", "reward_func_ground_truth"))
    out = rewards(COMPLETIONS, [None, None], ROWS)
    values = {name.rpartition(":")[2]: v.tolist() for name, v in out.per_function.items()}
    lengths = [float(len(c)) for c in COMPLETIONS]
    assert values == {
        "reward_len": [-abs(20 - n) for n in lengths],
        "reward_func_characters": lengths,
        "reward_func_ground_truth": [1.0, 0.0],  # (the docs' expected output)
    }
    assert out.total.tolist() == [sum(v[i] for v in values.values()) for i in range(2)]


def test_conversational_completions_are_messages_as_in_trl():
    """Example 2 reads ``completion[0]["content"]``: after a conversation TRL passes each response as messages."""
    prompts = [[{"role": "user", "content": "What is the result of (1 + 2) * 4?"}]] * 2
    completions = [
        "<think>The sum of 1 and 2 is 3, which we multiply by 4 to get 12.</think><answer>(1 + 2) * 4 = 12</answer>",
        "The sum of 3 and 1 is 4, which we multiply by 2 to get 8. So (3 + 1) * 2 = 8.",
    ]
    rewards = _bound(_set("format_reward_func", columns=("prompt",)), prompts=prompts)
    assert rewards(completions, [None, None], [{}, {}]).total.tolist() == [1.0, 0.0]  # (the docs' [1.0, 0.0])


def test_none_means_does_not_apply():
    """Example 4: each task's function returns None for the other task's rows; a row no function scores is NaN
    and its advantage 0, the others are normalized among the rows scored (TRL's NaN-aware group statistics)."""
    prompts = ["What is 2+2?", "Write a function that returns the sum of two numbers.", "What is 3*4?", "Say hi"]
    completions = ["4", "def f(a, b): return a + b", "11", "hi"]
    rows = [{"task": t} for t in ("math", "coding", "math", "chat")]
    rewards = _bound(_set("math_reward_func", "coding_reward_func", columns=("prompt", "task")), prompts=prompts)
    out = rewards(completions, [None] * 4, rows)
    math_values, coding_values = out.per_function.values()
    assert [None if math.isnan(v) else v for v in math_values.tolist()] == [1.0, None, -1.0, None]
    assert [None if math.isnan(v) else v for v in coding_values.tolist()] == [None, 1.0, None, None]
    assert out.total.tolist()[:3] == [1.0, 1.0, -1.0] and math.isnan(out.total[3])
    advantages = group_advantages(out.total, group_size=4)
    scored = torch.tensor([1.0, 1.0, -1.0])
    expected = (scored - scored.mean()) / (scored.std() + 1e-4)
    assert torch.allclose(advantages[:3], expected) and advantages[3] == 0


def test_async_and_logging_examples():
    rewards = _bound(_set("async_reward_func", "reward_func_logging"))
    out = rewards(COMPLETIONS, [None, None], ROWS)
    assert out.per_function[f"{DOC}:async_reward_func"].tolist() == [1.0, 1.0]
    assert out.per_function[f"{DOC}:reward_func_logging"].tolist() == [1.0, 0.0]
    assert out.extra == {"golden_answer": ["2", "5"], "extracted_answer": ["2", "6"]}
    assert out.logged == {"accuracy": [0.5]}


def test_trainer_state_is_passed(tmp_path):
    (tmp_path / "scheduled.py").write_text(
        "def scheduled(completions, trainer_state, **kwargs):\n"
        "    return [trainer_state.global_step / trainer_state.max_steps for _ in completions]\n"
    )
    rewards = _bound(RewardSet([f"{tmp_path}/scheduled.py:scheduled"], columns=("prompt",)), step=4)
    assert rewards(COMPLETIONS, [None, None], ROWS).total.tolist() == pytest.approx([0.4, 0.4])


def test_trls_signature_rule_at_start_up(tmp_path):
    """Example 1 names ``completions_ids``, which TRL never passes (it passes completion_ids): refused when the set
    is built, naming it, instead of a TypeError after the first rollout."""
    with pytest.raises(
        ConfigError, match=r"reward_func_tokens\(completions_ids, \*\*kwargs\): TRL passes .*'completions_ids'"
    ):
        _set("reward_func_tokens")
    (tmp_path / "strict.py").write_text(
        "def strict(completions, trainer_state):\n    return [0.0] * len(completions)\n"
    )
    with pytest.raises(ConfigError, match="takes no prompts, completion_ids, log_extra, log_metric; add \\*\\*kwargs"):
        RewardSet([f"{tmp_path}/strict.py:strict"])
