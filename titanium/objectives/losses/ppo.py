"""PPO's math as pure functions: KL-penalized per-token rewards, GAE, whitening, clipped policy and value losses.

B responses, T response positions; ``mask`` ``[B, T]`` marks each response's generated tokens (a contiguous run
from position 0, a final stop id included). The semantics are torchtune's PPO recipe (``rlhf.get_rewards_ppo``,
``rlhf.estimate_advantages``, ``rlhf.masked_whiten``, ``loss.PPOLoss``), term by term
(``tests/unit/test_ppo_loss.py`` checks each against a plain reference):

    kl_t       = logprobs_t - ref_logprobs_t                                   (k1, on the sampled tokens)
    reward_t   = -kl_coef kl_t, plus the sequence's score at its last token
    delta_t    = reward_t + gamma V_{t+1} - V_t          (V = 0 past the response's end)
    A_t        = delta_t + gamma lambda A_{t+1};  returns_t = A_t + V_t;  A whitened over the masked tokens
    policy     = max(-A r, -A clip(r, 1 - epsilon, 1 + epsilon)),  r = exp(logprobs - old_logprobs)
    value      = 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)
    loss       = policy + vf_coef value, per masked token

torchtune averages each term over a minibatch's masked tokens; here a microbatch returns the sum over its masked
tokens, and the loop divides a step's sum by the step's masked tokens over every rank: the same value on one
microbatch, the exact token mean under gradient accumulation and data parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from titanium.objectives.losses.grpo import clipped_policy_loss

WHITEN_EPS = 1e-8
"""Added to the variance before the square root (torchtune's and TRL's ``masked_whiten``)."""


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` index of each row's last masked position (0 for a row with none)."""
    positions = torch.arange(mask.shape[1], device=mask.device)
    return (positions * mask).argmax(dim=1)


def kl_penalized_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    mask: torch.Tensor,
    kl_coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rewards, kl)``, both ``[B, T]`` and 0 outside ``mask``: ``-kl_coef x kl`` per token, with each response's
    score ``[B]`` added at its last token (a row without tokens gets none). ``ref_logprobs`` None: no penalty."""
    weights = mask.to(logprobs.dtype)
    kl = (logprobs - ref_logprobs) * weights if ref_logprobs is not None else torch.zeros_like(logprobs)
    rewards = -kl_coef * kl
    last = last_token_index(mask)
    rewards[torch.arange(len(scores), device=scores.device), last] += scores.to(rewards.dtype) * mask.any(dim=1)
    return rewards, kl


def generalized_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` ``[B, T]`` by GAE (Schulman et al. 2016), not whitened; values and rewards past a
    response's end count as 0, so a response's last token bootstraps from nothing."""
    weights = mask.to(values.dtype)
    values, rewards = values * weights, rewards * weights
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        next_value = values[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    return advantages, advantages + values


def whiten(
    values: torch.Tensor, mask: torch.Tensor, group: dist.ProcessGroup | None = None, scale: int = 1
) -> torch.Tensor:
    """``values`` shifted to mean 0 and scaled to unit (unbiased) variance over the masked entries; 0 outside.

    With ``group`` the moments are those of every rank's masked entries together, so the result does not depend on
    how the batch is split over data-parallel ranks; ``scale`` is how many ranks of ``group`` hold each batch (the
    tensor- and pipeline-parallel ranks of one data-parallel rank), whose sums count once."""
    weights = mask.to(values.dtype)
    stats = torch.stack([weights.sum(), (values * weights).sum()]).double()
    if group is not None:
        dist.all_reduce(stats, group=group)
        stats /= scale
    count, total = stats[0], stats[1]
    mean = (total / count.clamp(min=1)).to(values.dtype)
    squares = (((values - mean) * weights) ** 2).sum().double()
    if group is not None:
        dist.all_reduce(squares, group=group)
        squares /= scale
    variance = (squares / (count - 1).clamp(min=1)).to(values.dtype)
    return (values - mean) * torch.rsqrt(variance + WHITEN_EPS) * weights


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, clipped)`` per token: half the larger squared error of the value and of the value clipped to
    ``old_values ± clip`` (the clip only ever raises the loss), and where the clipped error was the larger."""
    clipped_values = torch.clamp(values, old_values - clip, old_values + clip)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped_error, clipped_error), clipped_error > unclipped_error


@dataclass
class ValueSums:
    """A microbatch's clipped value loss per response, summed over its masked tokens, and how many of them the clip
    took: with the value model's gradient when it runs in the policy's loss, constants when it trained apart."""

    loss: torch.Tensor
    """``[B]``"""
    clipped: torch.Tensor
    """``[B]``"""


def value_sums(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float
) -> ValueSums:
    """The clipped value loss of each response (``clipped_value_loss`` summed over its masked tokens)."""
    value, clipped = clipped_value_loss(values, old_values, returns, clip)
    return ValueSums((value * mask.to(value.dtype)).sum(dim=1), (clipped & mask).sum(dim=1))


@dataclass
class PPOLossSums:
    """A microbatch's loss and metrics as sums over its masked tokens (the loop divides by the step's tokens)."""

    loss: torch.Tensor
    policy: torch.Tensor
    value: torch.Tensor
    clipped: torch.Tensor
    """Tokens whose policy term the clip took (torchtune's clipfrac numerator)."""
    value_clipped: torch.Tensor
    approx_kl: torch.Tensor
    """0.5 (logprobs - old_logprobs)^2 summed (how far the policy moved from the one that sampled)."""
    tokens: torch.Tensor


def ppo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    value: ValueSums,
    *,
    epsilon: float,
    vf_coef: float,
) -> PPOLossSums:
    """The clipped PPO loss of a microbatch, summed over its masked tokens: policy + ``vf_coef`` x ``value``'s."""
    weights = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    policy, clipped_low, clipped_high = clipped_policy_loss(torch.exp(log_ratio), advantages, epsilon, epsilon)
    policy_sum, value_sum = (policy * weights).sum(), value.loss.sum()
    return PPOLossSums(
        loss=policy_sum + vf_coef * value_sum,
        policy=policy_sum.detach(),
        value=value_sum.detach(),
        clipped=((clipped_low | clipped_high) & mask).sum(),
        value_clipped=value.clipped.sum(),
        approx_kl=(0.5 * log_ratio.detach() ** 2 * weights).sum(),
        tokens=mask.sum(),
    )
