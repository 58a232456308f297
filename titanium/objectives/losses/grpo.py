"""GRPO's loss family as pure functions: one importance ratio, one per-token surrogate, one normalizer.

B responses, T response positions. ``logprobs`` ``[B, T]`` are the response tokens' log-probs under the policy
being trained, ``old_logprobs`` under the policy that sampled them (or their recomputation), ``ref_logprobs`` under
the frozen reference (all with the temperature convention of ``titanium.generation.sampling``); ``mask`` marks the
tokens that carry loss, A_i is response i's advantage. The variants are TRL's ``GRPOTrainer`` loss types, term by
term (``tests/unit/test_grpo_trl.py`` compares loss and gradients with a real ``GRPOTrainer``):

    ratio     token:    r_it = exp(logprobs_it - old_it)                                  (grpo dapo dr_grpo bnpo cispo)
              sequence: r_i  = exp(sum_t mask_it (logprobs_it - old_it) / max(L_i, 1))    (gspo; L_i = sum_t mask_it)
    surrogate clipped:  p = -min(min(r, delta) A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A)  (delta: two-sided
                        clipping, off by default)
              cispo:    p = -sg(min(r, cispo_cap)) A logprobs                       (no token loses its gradient)
    then      p * w (importance weights for the engine mismatch, ``titanium.objectives.grpo_correction``)
              + beta k3, with k3 = exp(ref - logprobs) - (ref - logprobs) - 1, times r if ``kl_bias_correction``

The normalizer is where the variants differ most. The loop divides the summed loss of a step by the step's units
counted over every microbatch and data-parallel rank (all-reduced once, before the forward), so each variant states
its loss as a sum over units (``aggregate``) and its units (``loss_units``):

    dapo, cispo    sum over tokens                      / tokens of the step               (global token mean)
    grpo, gspo     sum over responses of their token mean / responses of the step          (also the masked ones)
    dr_grpo        sum over tokens                      / (responses of the step x max_new_tokens)
    bnpo           sum over microbatches of their token mean / microbatches of the step

That is TRL's value exactly under gradient accumulation and data parallelism: TRL divides each micro-batch's loss by
the accumulation steps G (grpo, dr_grpo, bnpo) or by the generation batch's tokens over P processes (dapo, cispo), and
data parallelism averages over P, so its step loss is the same sum over the same global count.
"""

from __future__ import annotations

from typing import Literal

import torch

from titanium.config.sections import GRPOSection

LossType = Literal["grpo", "dapo", "dr_grpo", "bnpo", "gspo", "cispo"]


def importance_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, level: Literal["token", "sequence"]
) -> torch.Tensor:
    """``[B, T]`` token ratios, or ``[B, 1]`` sequence ratios (the geometric mean of a response's masked token
    ratios, GSPO's), of the trained policy over the sampling one."""
    log_ratio = logprobs - old_logprobs
    if level == "token":
        return torch.exp(log_ratio)
    weights = mask.to(log_ratio.dtype)
    return torch.exp((log_ratio * weights).sum(dim=1, keepdim=True) / weights.sum(dim=1, keepdim=True).clamp_min(1))


def clipped_policy_loss(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, clipped_low, clipped_high)``, shaped like ``ratio``: the clipped surrogate loss, and where the clip
    took the gradient away (ratio below ``1 - epsilon_low`` with A < 0, or above ``1 + epsilon_high`` with A > 0).
    ``advantages``: one per response ``[B]`` (GRPO) or one per token ``[B, T]`` (PPO).

    ``delta`` (two-sided clipping, INTELLECT-2) caps the unclipped term's ratio, so a token with A < 0 whose ratio
    has run far above 1 is pushed down with weight at most ``delta`` instead of its ratio."""
    adv = (advantages[:, None] if advantages.dim() == 1 else advantages).to(ratio.dtype)
    unclipped = ratio if delta is None else ratio.clamp(max=delta)
    loss = -torch.minimum(unclipped * adv, ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * adv)
    clipped_low = (ratio < 1 - epsilon_low) & (adv < 0)
    clipped_high = (ratio > 1 + epsilon_high) & (adv > 0)
    return loss, clipped_low, clipped_high


def cispo_policy_loss(
    ratio: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, capped)``: CISPO's per-token loss ``-sg(min(r, cap)) A logprobs`` (MiniMax-M1), a REINFORCE term
    whose importance weight is capped and never cut to zero, and where the cap bit (r > cap with A > 0)."""
    adv = advantages[:, None].to(ratio.dtype)
    loss = -ratio.clamp(max=cap).detach() * adv * logprobs
    return loss, (ratio > cap) & (adv > 0)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference) from the sampled tokens' log-probs."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def loss_mask(generated: torch.Tensor, finished: torch.Tensor, mask_truncated: bool) -> torch.Tensor:
    """``[B, T]`` tokens that carry loss: the generated ones, without truncated responses if ``mask_truncated``."""
    return generated & finished[:, None] if mask_truncated else generated


def loss_units(mask: torch.Tensor, loss_type: LossType, max_new_tokens: int) -> torch.Tensor:
    """How many of the loop's loss units a microbatch with ``mask`` ``[B, T]`` holds (see the module docstring):
    its masked tokens, its responses (all B, masked or not: TRL's mean over the rows), B x ``max_new_tokens``, or 1
    (the microbatch itself)."""
    if loss_type in ("dapo", "cispo"):
        return mask.sum()
    rows = torch.tensor(mask.shape[0], device=mask.device)
    if loss_type in ("grpo", "gspo"):
        return rows
    if loss_type == "dr_grpo":
        return rows * max_new_tokens
    if loss_type == "bnpo":
        return torch.ones((), dtype=torch.long, device=mask.device)
    raise ValueError(f"unknown GRPO loss type {loss_type!r}")


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, loss_type: LossType, max_new_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, units)`` of a microbatch for the loop, which divides the step's summed loss by its units."""
    weights = mask.to(per_token.dtype)
    units = loss_units(mask, loss_type, max_new_tokens)
    masked = per_token * weights
    if loss_type in ("grpo", "gspo"):
        return (masked.sum(dim=1) / weights.sum(dim=1).clamp_min(1)).sum(), units
    if loss_type == "bnpo":
        return masked.sum() / weights.sum().clamp_min(1), units
    return masked.sum(), units


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: GRPOSection,
    ref_logprobs: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    max_new_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss_sum, units, metrics)``: the GRPO loss of a microbatch of responses, of ``cfg.loss_type``;
    ``max_new_tokens`` (dr_grpo's normalizer; default: the responses' width T) is ``--rl.max_new_tokens``.

    ``is_weights`` (``[B, T]`` or ``[B, 1]``, no gradient) multiply the policy term before the KL is added: the
    truncated or masked importance weights of ``grpo_correction``. ``metrics`` are sums over the masked tokens, for
    the loop to reduce across ranks and divide: ``clipped_low`` and ``clipped_high`` (clip fraction = their sum /
    ``tokens``; for cispo ``clipped_high`` counts where the cap bit), ``kl`` (with beta > 0).
    """
    level = "sequence" if cfg.loss_type == "gspo" else "token"
    ratio = importance_ratio(logprobs, old_logprobs, mask, level)
    if cfg.loss_type == "cispo":
        per_token, clipped_high = cispo_policy_loss(ratio, logprobs, advantages, cfg.cispo_cap)
        clipped_low = torch.zeros_like(clipped_high)
    else:
        per_token, clipped_low, clipped_high = clipped_policy_loss(
            ratio, advantages, cfg.epsilon_low, cfg.epsilon_high, cfg.delta
        )
    if is_weights is not None:
        per_token = per_token * is_weights
    metrics = {
        "tokens": mask.sum(),
        "clipped_low": (clipped_low & mask).sum(),
        "clipped_high": (clipped_high & mask).sum(),
    }
    if cfg.beta > 0:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs the reference policy's log-probs")
        kl = k3_kl(logprobs, ref_logprobs)
        metrics["kl"] = (kl.detach() * mask).sum()
        per_token = per_token + cfg.beta * (kl * ratio if cfg.kl_bias_correction else kl)
    width = mask.shape[1] if max_new_tokens is None else max_new_tokens
    loss_sum, units = aggregate(per_token.expand_as(mask), mask, cfg.loss_type, width)
    return loss_sum, units, metrics
