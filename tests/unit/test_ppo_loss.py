"""PPO's math (titanium/objectives/losses/ppo.py) against a plain reference on fixed rollouts.

The reference below is written from torchtune's PPO terms (``rlhf.get_rewards_ppo``, ``rlhf.estimate_advantages``,
``loss.PPOLoss``) with titanium's two conventions where torchtune 0.6.1 differs (the score at the last generated
token, not one position later; advantages whitened to mean 0, where torchtune adds the mean back: see the module
docstring of losses/ppo.py), one scalar at a time in float64, with no code shared with titanium; TRL 1.16 has no PPO
trainer left to compare with. titanium computes in float32; tolerance 1e-6 absolute on rewards,
advantages, returns, the loss and its gradients (values of order 1).
"""

from __future__ import annotations

import math

import pytest
import torch

from titanium.objectives.losses.ppo import (
    PPOLossSums,
    generalized_advantages,
    kl_penalized_rewards,
    ppo_loss,
    value_sums,
    whiten,
)

ATOL = 1e-6
B, T = 6, 9
KL_COEF, GAMMA, LAM, EPSILON, VALUE_CLIP, VF_COEF = 0.1, 0.97, 0.9, 0.2, 0.3, 0.25


def rollouts(seed: int = 0) -> dict[str, torch.Tensor]:
    """Fixed rollouts: B responses of lengths 1..T (one empty), log-probs, values and scores of order 1."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T, 1, 4, 0, 7, 5])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = -torch.rand(B, T, generator=g) * 2
    return {
        "mask": mask,
        "old_logprobs": old,
        "ref_logprobs": old + 0.3 * torch.randn(B, T, generator=g),
        "logprobs": old + 0.4 * torch.randn(B, T, generator=g),  # far enough from old for the clip to bite
        "old_values": torch.randn(B, T, generator=g),
        "values": torch.randn(B, T, generator=g),
        "scores": torch.randn(B, generator=g) * 2,
    }


# ----- the reference: torchtune's recipe, element by element, float64 -----


def reference_rewards(r: dict[str, torch.Tensor]) -> list[list[float]]:
    """get_rewards_ppo: -kl_coeff (logprobs - ref_logprobs) per token, score added at the last response token;
    the recipe sets padding positions' log-probs so their KL is 0."""
    out = []
    for i in range(B):
        n = int(r["mask"][i].sum())
        row = [
            -KL_COEF * (float(r["old_logprobs"][i, t]) - float(r["ref_logprobs"][i, t])) if t < n else 0.0
            for t in range(T)
        ]
        if n:
            row[n - 1] += float(r["scores"][i])
        out.append(row)
    return out


def reference_gae(
    rewards: list[list[float]], r: dict[str, torch.Tensor]
) -> tuple[list[list[float]], list[list[float]]]:
    """estimate_advantages: GAE over the padded rows (values zeroed on padding, as the recipe does), returns =
    advantages + values, then masked_whiten (unbiased variance, 1e-8) over the masked tokens."""
    raw, returns = [], []
    for i in range(B):
        n = int(r["mask"][i].sum())
        values = [float(r["old_values"][i, t]) if t < n else 0.0 for t in range(T)]
        last, row = 0.0, [0.0] * T
        for t in reversed(range(T)):
            next_value = values[t + 1] if t < T - 1 else 0.0
            delta = rewards[i][t] + GAMMA * next_value - values[t]
            last = delta + GAMMA * LAM * last
            row[t] = last
        raw.append(row)
        returns.append([a + v for a, v in zip(row, values)])
    masked = [raw[i][t] for i in range(B) for t in range(T) if r["mask"][i, t]]
    mean = sum(masked) / len(masked)
    var = sum((x - mean) ** 2 for x in masked) / (len(masked) - 1)
    whitened = [
        [(raw[i][t] - mean) / math.sqrt(var + 1e-8) if r["mask"][i, t] else 0.0 for t in range(T)] for i in range(B)
    ]
    return whitened, returns


def reference_loss(r, advantages, returns, logprobs, values) -> torch.Tensor:
    """PPOLoss.forward with padding masks: masked means of the clipped policy loss and of 0.5 x the clipped value
    loss (float64 tensors, for autograd)."""
    mask = r["mask"].double()
    adv, ret = torch.tensor(advantages, dtype=torch.float64), torch.tensor(returns, dtype=torch.float64)
    ratios = torch.exp(logprobs - r["old_logprobs"].double())
    policy = torch.maximum(-adv * torch.clamp(ratios, 1 - EPSILON, 1 + EPSILON), -adv * ratios)
    old_values = r["old_values"].double()
    values_clipped = torch.clamp(values, old_values - VALUE_CLIP, old_values + VALUE_CLIP)
    value = torch.maximum((values - ret) ** 2, (values_clipped - ret) ** 2)
    masked_mean = lambda x: (x * mask).sum() / mask.sum()  # noqa: E731
    return masked_mean(policy) + VF_COEF * 0.5 * masked_mean(value)


# ----- titanium against it -----


def titanium_advantages(r):
    rewards, _ = kl_penalized_rewards(r["scores"], r["old_logprobs"], r["ref_logprobs"], r["mask"], KL_COEF)
    advantages, returns = generalized_advantages(rewards, r["old_values"], r["mask"], GAMMA, LAM)
    return rewards, whiten(advantages, r["mask"]), returns


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rewards_advantages_returns_match_reference(seed: int) -> None:
    r = rollouts(seed)
    rewards, advantages, returns = titanium_advantages(r)
    ref_rewards = reference_rewards(r)
    ref_advantages, ref_returns = reference_gae(ref_rewards, r)
    mask = r["mask"]
    torch.testing.assert_close(rewards.double(), torch.tensor(ref_rewards, dtype=torch.float64), rtol=0, atol=ATOL)
    torch.testing.assert_close(
        advantages.double(), torch.tensor(ref_advantages, dtype=torch.float64), rtol=0, atol=ATOL
    )
    # (returns past a response's end are never used: titanium's and the recipe's differ only there)
    torch.testing.assert_close(
        (returns * mask).double(), torch.tensor(ref_returns, dtype=torch.float64) * mask, rtol=0, atol=ATOL
    )
    assert advantages.dtype == torch.float32


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_and_gradients_match_reference(seed: int) -> None:
    r = rollouts(seed)
    _, advantages, returns = titanium_advantages(r)
    ref_advantages, ref_returns = reference_gae(reference_rewards(r), r)

    logprobs = r["logprobs"].clone().requires_grad_(True)
    values = r["values"].clone().requires_grad_(True)
    value = value_sums(values, r["old_values"], returns, r["mask"], VALUE_CLIP)
    sums = ppo_loss(logprobs, r["old_logprobs"], advantages, r["mask"], value, epsilon=EPSILON, vf_coef=VF_COEF)
    loss = sums.loss / sums.tokens  # what the loop does with one microbatch
    loss.backward()

    ref_logprobs = r["logprobs"].double().requires_grad_(True)
    ref_values = r["values"].double().requires_grad_(True)
    ref = reference_loss(r, ref_advantages, ref_returns, ref_logprobs, ref_values)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= ATOL, (loss.item(), ref.item())
    torch.testing.assert_close(logprobs.grad.double(), ref_logprobs.grad, rtol=0, atol=ATOL)
    torch.testing.assert_close(values.grad.double(), ref_values.grad, rtol=0, atol=ATOL)
    assert 0 < sums.clipped < sums.tokens and 0 < sums.value_clipped < sums.tokens  # both clips were exercised


def test_token_sums_split_into_microbatches_give_the_whole_batch_mean() -> None:
    """Two microbatches' sums over the step's tokens equal the one-microbatch mean (the loop's division)."""
    r = rollouts(0)
    _, advantages, returns = titanium_advantages(r)
    parts = [slice(0, 2), slice(2, B)]

    def loss(p: slice) -> PPOLossSums:
        value = value_sums(r["values"][p], r["old_values"][p], returns[p], r["mask"][p], VALUE_CLIP)
        logprobs, old = r["logprobs"][p], r["old_logprobs"][p]
        return ppo_loss(logprobs, old, advantages[p], r["mask"][p], value, epsilon=EPSILON, vf_coef=VF_COEF)

    whole, split = loss(slice(0, B)), [loss(p) for p in parts]
    total = sum(s.loss for s in split) / sum(s.tokens for s in split)
    assert abs(float(total - whole.loss / whole.tokens)) <= ATOL


def test_no_reference_means_no_penalty_and_empty_rows_get_no_score() -> None:
    r = rollouts(0)
    rewards, kl = kl_penalized_rewards(r["scores"], r["logprobs"], None, r["mask"], KL_COEF)
    assert not kl.any()
    assert not rewards[3].any()  # the empty response
    assert rewards[1, 0] == r["scores"][1] and not rewards[1, 1:].any()
