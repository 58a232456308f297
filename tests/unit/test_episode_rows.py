"""Rows with holes in their loss mask (multi-turn episodes: environment tokens between the policy's turns) through
what reads the mask: PPO's GAE skips the holes (equal to GAE over the policy tokens alone, and unchanged on
contiguous masks), reward models and values score at the last policy token, a microbatch keeps the columns up to
its last policy token, and the GRPO loss counts only policy tokens."""

from __future__ import annotations

import torch

from titanium.config.sections import GRPOSection
from titanium.objectives.losses.grpo import grpo_loss, loss_units
from titanium.objectives.losses.ppo import generalized_advantages
from titanium.rl.rewards.scores import score_positions
from titanium.rl.rollout import narrow

MASK = torch.tensor(
    [
        [1, 1, 0, 0, 0, 1, 1, 0, 1, 0],  # three policy turns, two environment turns
        [1, 1, 1, 1, 0, 0, 0, 0, 0, 0],  # one turn
        [1, 0, 0, 1, 1, 1, 0, 0, 0, 0],
    ],
    dtype=torch.bool,
)


def reference_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """GAE over a plain sequence (the policy's tokens alone)."""
    out, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(values) else 0.0
        running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running
        out[t] = running
    return out


def test_gae_skips_the_environment_tokens() -> None:
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(MASK.shape, generator=g), torch.randn(MASK.shape, generator=g)
    advantages, returns = generalized_advantages(rewards, values, MASK, 0.9, 0.8)
    for row in range(len(MASK)):
        kept = MASK[row]
        expected = reference_gae(rewards[row][kept].tolist(), values[row][kept].tolist(), 0.9, 0.8)
        torch.testing.assert_close(advantages[row][kept], torch.tensor(expected), rtol=0, atol=1e-6)
        assert (advantages[row][~kept] == 0).all() and (returns[row][~kept] == 0).all()
    contiguous = torch.arange(10)[None, :] < torch.tensor([[7], [3], [10]])
    advantages, _ = generalized_advantages(rewards, values, contiguous, 0.9, 0.8)
    for row, n in enumerate((7, 3, 10)):
        expected = reference_gae(rewards[row, :n].tolist(), values[row, :n].tolist(), 0.9, 0.8)
        torch.testing.assert_close(advantages[row, :n], torch.tensor(expected), rtol=0, atol=1e-6)


def test_scores_and_columns_follow_the_last_policy_token() -> None:
    rows = {"tokens": torch.zeros(3, 4 + 10, dtype=torch.long)}
    assert score_positions(rows, MASK).nonzero()[:, 1].tolist() == [4 + 8, 4 + 3, 4 + 5]
    empty = torch.zeros(1, 10, dtype=torch.bool)
    assert score_positions({"tokens": torch.zeros(1, 14, dtype=torch.long)}, empty).nonzero()[:, 1].tolist() == [3]
    inputs = {
        "tokens": torch.arange(3 * 14).view(3, 14),
        "positions": torch.arange(14).repeat(3, 1),
        "document_ids": torch.ones(3, 14, dtype=torch.long),
        "response_mask": MASK,
    }
    kept = narrow(inputs, MASK[1:], pad_multiple=1)  # (rows 2 and 3 end at response column 6)
    assert kept["tokens"].shape[1] == 4 + 6 and torch.equal(kept["response_mask"], MASK[:, :6])


def test_grpo_counts_only_policy_tokens() -> None:
    g = torch.Generator().manual_seed(1)
    logprobs, old = -torch.rand(MASK.shape, generator=g), -torch.rand(MASK.shape, generator=g)
    advantages = torch.tensor([1.0, -0.5, 0.25])
    for loss_type in ("dapo", "grpo"):
        cfg = GRPOSection(loss_type=loss_type)
        loss_sum, units, sums = grpo_loss(logprobs, old, advantages, MASK, cfg)
        per_token = -torch.minimum(
            torch.exp(logprobs - old) * advantages[:, None],
            torch.exp(logprobs - old).clamp(1 - cfg.epsilon_low, 1 + cfg.epsilon_high) * advantages[:, None],
        )
        if loss_type == "dapo":
            expected, expected_units = per_token[MASK].sum(), MASK.sum()
        else:
            expected = sum(per_token[r][MASK[r]].mean() for r in range(3))
            expected_units = torch.tensor(3)
        torch.testing.assert_close(loss_sum, expected)
        assert units == expected_units == loss_units(MASK, cfg.loss_type, 10) and sums["tokens"] == MASK.sum()
