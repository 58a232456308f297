"""PPO's math as pure functions: KL-penalized per-token rewards, GAE, whitening, clipped policy and value losses.

B responses, T response positions; ``mask`` ``[B, T]`` marks each response's generated tokens (a contiguous run
from position 0, a final stop id included). The terms are those of torchtune's PPO recipe (``rlhf.get_rewards_ppo``,
``rlhf.estimate_advantages``, ``loss.PPOLoss``) with two conventions of titanium's where torchtune 0.6.1 differs
(``tests/unit/test_ppo_loss.py`` checks each term against a plain reference of the formulas below):

- the score is added at the response's last generated token (its stop token, or the last one of a truncated
  response); torchtune's recipe adds it one position later (``value_seq_idxs = seq_lens + 1`` when the response is
  shorter than ``max_generated_tokens - 1``) and keeps that position's value in GAE;
- the whitened advantages have mean 0 and unit (unbiased) variance over the masked tokens; torchtune's ``whiten``
  (``shift_mean=True``, what ``estimate_advantages`` calls) adds the mean back.


    kl_t       = logprobs_t - ref_logprobs_t                                   (k1, on the sampled tokens)
    reward_t   = -kl_coef kl_t, plus the sequence's score at its last token
    delta_t    = reward_t + gamma V_{t+1} - V_t          (V = 0 past the response's end)
    A_t        = delta_t + gamma lambda A_{t+1};  returns_t = A_t + V_t;  A whitened to mean 0, variance 1
    policy     = max(-A r, -A clip(r, 1 - epsilon, 1 + epsilon)),  r = exp(logprobs - old_logprobs)
    value      = 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)
    loss       = policy + vf_coef value, per masked token

torchtune averages each term over a minibatch's masked tokens; here a microbatch returns the sum over its masked
tokens, and the loop divides a step's sum by the step's masked tokens over every rank: the same value on one
microbatch, the exact token mean under gradient accumulation and data parallelism.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

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
    """``(advantages, returns)`` ``[B, T]`` by GAE (Schulman et al. 2016), not whitened, over each response's masked
    tokens: a token's successor is the next masked one (a multi-turn episode's environment tokens between the policy's
    turns are skipped, as verl's multi-turn GAE does), and a response's last token bootstraps from nothing. Outside
    the mask: 0 advantage and value."""
    weights = mask.to(values.dtype)
    values, rewards = values * weights, rewards * weights
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(running)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        here = mask[:, t]
        running = torch.where(here, delta + gamma * lam * running, running)
        next_value = torch.where(here, values[:, t], next_value)
        advantages[:, t] = running * weights[:, t]
    return advantages, advantages + values


def whiten(
    values: torch.Tensor, mask: torch.Tensor, sum_over_data: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """``values`` shifted to mean 0 and scaled to unit (unbiased) variance over the masked entries; 0 outside.

    With ``sum_over_data`` (``ObjectiveContext.sum_over_data``) the moments are those of every data-parallel rank's
    masked entries together, so the result does not depend on how the batch is split over ranks."""
    total = sum_over_data or (lambda t: t)
    weights = mask.to(values.dtype)
    count, sum_ = total(torch.stack([weights.sum(), (values * weights).sum()]).double())
    mean = (sum_ / count.clamp(min=1)).to(values.dtype)
    squares = total((((values - mean) * weights) ** 2).sum().double())
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
