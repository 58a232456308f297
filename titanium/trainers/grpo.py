"""GRPO's math as pure functions: group-relative advantages, the clipped ratio objective, the k3 KL to a
reference policy, and the two ways of adding token losses up into the loop's "sum over loss units".

B responses (prompts x group_size, each group's responses contiguous), T response positions.
``logprobs`` ``[B, T]`` are the response tokens' log-probs under the policy being trained,
``old_logprobs`` under the policy that sampled them, ``ref_logprobs`` under the frozen reference (all
with the temperature convention of ``titanium.generation.sampling``); ``mask`` marks the tokens that
count. Per token t of response i with advantage A_i:

    ratio       r = exp(logprobs - old_logprobs)
    policy      p = -min(r A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A)
    KL (k3)     k = exp(ref - logprobs) - (ref - logprobs) - 1     (>= 0; unbiased for KL(policy || ref))
    loss        p + beta k

The objective (rollouts in the prepare phase, old and reference log-probs, ppo_epochs x minibatches
optimizer steps per rollout batch) is built on these functions.
"""

from __future__ import annotations

from typing import Literal

import torch

from titanium.config.sections import GRPOSection


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: Literal["group", "batch", "none"] = "group", eps: float = 1e-4
) -> torch.Tensor:
    """``[B]`` advantages: each reward minus the mean of its group of ``group_size`` contiguous responses,
    divided by the group's standard deviation (``group``), that of all of ``rewards`` (``batch``), or not
    at all (``none``); ``eps`` keeps a group of equal rewards at 0. Standard deviations are unbiased
    (n - 1), as in the reference implementations."""
    grouped = rewards.float().view(-1, group_size)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        advantages = advantages / (grouped.std() + eps)
    elif scale != "none":
        raise ValueError(f"unknown reward scaling {scale!r}")
    return advantages.flatten()


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, clipped_low, clipped_high)``, each ``[B, T]``: the per-token clipped surrogate loss, and
    where the clip took the gradient away (ratio below ``1 - epsilon_low`` with A < 0, or above
    ``1 + epsilon_high`` with A > 0)."""
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None].to(ratio.dtype)
    loss = -torch.minimum(ratio * adv, ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * adv)
    clipped_low = (ratio < 1 - epsilon_low) & (adv < 0)
    clipped_high = (ratio > 1 + epsilon_high) & (adv > 0)
    return loss, clipped_low, clipped_high


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference) from the sampled tokens' log-probs."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def loss_mask(generated: torch.Tensor, finished: torch.Tensor, mask_truncated: bool) -> torch.Tensor:
    """``[B, T]`` tokens that carry loss: the generated ones, without truncated responses if ``mask_truncated``."""
    return generated & finished[:, None] if mask_truncated else generated


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, mode: Literal["token", "sequence"]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, units)`` for the loop, which divides the sum by the units counted over the whole step.

    token: the sum over masked tokens; units are tokens. sequence: the sum over responses of each
    response's mean over its masked tokens; units are responses with at least one masked token.
    """
    weights = mask.to(per_token.dtype)
    if mode == "token":
        return (per_token * weights).sum(), mask.sum()
    if mode == "sequence":
        counts = weights.sum(dim=1)
        return ((per_token * weights).sum(dim=1) / counts.clamp_min(1)).sum(), (counts > 0).sum()
    raise ValueError(f"unknown loss aggregation {mode!r}")


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: GRPOSection,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss_sum, units, metrics)``: the GRPO loss of a microbatch of responses.

    ``metrics`` are sums over the masked tokens, for the loop to reduce across ranks and divide:
    ``clipped_low`` and ``clipped_high`` (clip fraction = their sum / ``tokens``), ``kl`` (with beta > 0).
    """
    per_token, clipped_low, clipped_high = clipped_policy_loss(
        logprobs, old_logprobs, advantages, cfg.epsilon_low, cfg.epsilon_high
    )
    metrics = {
        "tokens": mask.sum(),
        "clipped_low": (clipped_low & mask).sum(),
        "clipped_high": (clipped_high & mask).sum(),
    }
    if cfg.beta > 0:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs the reference policy's log-probs")
        kl = k3_kl(logprobs, ref_logprobs)
        per_token = per_token + cfg.beta * kl
        metrics["kl"] = (kl.detach() * mask).sum()
    loss_sum, units = aggregate(per_token, mask, cfg.loss_aggregation)
    return loss_sum, units, metrics


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy ``[...]`` of the temperature-scaled next-token distributions of ``logits`` ``[..., V]`` (a metric:
    call it under ``no_grad``; it holds one more ``[..., V]`` float32 tensor)."""
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    logp = torch.log_softmax(scaled, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
