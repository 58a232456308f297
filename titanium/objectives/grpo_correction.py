"""Correcting for rollouts the trained policy did not sample itself: the engine/trainer mismatch and its weights.

A rollout engine (vLLM, or titanium's sampler in another precision) reports ``sampling_logprobs`` ``[B, T]`` of the
tokens it drew; the trainer's own forward of the same weights gives slightly different ``old_logprobs`` (other
kernels, bf16 accumulation order; a policy lag makes the gap larger). With ``old_logprobs`` recomputed by the trainer
(TRL's default), the PPO ratio is exactly 1 at the first step on a batch, and the samples are reweighted from the
distribution that drew them to the trainer's by an importance weight (TRL's ``vllm_importance_sampling_correction``,
term by term, checked against ``GRPOTrainer`` in tests/unit/test_grpo_trl.py):

    delta_it = mask_it (old_it - sampling_it)
    token:    rho_it = exp(delta_it)                 sequence: rho_i = exp(sum_t delta_it)  (the product, not a mean)
    truncate: rho <- clamp(rho, cap_min, cap_max)    mask:     rho <- 0 where rho < cap_min or rho > cap_max

The weights carry no gradient and multiply the per-token policy loss (``grpo_loss(..., is_weights=...)``).
``mismatch_metrics`` measures the gap every step.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


@torch.no_grad()
def importance_weights(
    old_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: ISMode,
    cap_max: float,
    cap_min: float | None = None,
) -> torch.Tensor:
    """``[B, T]`` (token modes) or ``[B, 1]`` (sequence modes) truncated or masked importance weights of the
    trainer's distribution over the engine's; NaN engine log-probs (tokens it could not score) count as no gap."""
    delta = torch.nan_to_num((old_logprobs - sampling_logprobs) * mask, nan=0.0)
    if mode.startswith("sequence"):
        delta = delta.sum(dim=1, keepdim=True)
    ratio = torch.exp(delta)
    if mode.endswith("truncate"):
        return ratio.clamp(min=cap_min, max=cap_max)
    low = -math.inf if cap_min is None else cap_min
    return ratio.masked_fill((ratio < low) | (ratio > cap_max), 0.0)


@torch.no_grad()
def mismatch_metrics(
    old_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(means, maxima, minima)`` of a microbatch, as the loop reduces them: ``means`` as (sum, count) pairs added
    over microbatches and ranks, ``maxima`` / ``minima`` to reduce with MAX / MIN.

    - ``grpo/logprob_mismatch``: mean |old - sampling| over the loss tokens (and its maximum);
    - with ``weights`` (the importance weights in use): ``grpo/is_weight`` mean, ``grpo/is_weight_sq`` (mean of the
      squares: spread = sqrt(sq - mean^2)), ``grpo/is_weight_min`` / ``_max``, each over loss tokens (token modes)
      or responses with a loss token (sequence modes), and ``grpo/is_changed``, the share of them the cap truncated
      or masked (a weight that differs from its untouched ratio).
    """
    gap = torch.nan_to_num((old_logprobs - sampling_logprobs).abs(), nan=0.0)
    tokens = mask.sum()
    means = {"grpo/logprob_mismatch": ((gap * mask).sum(), tokens)}
    maxima = {"grpo/logprob_mismatch_max": torch.where(mask, gap, 0.0).max()}
    minima: dict[str, torch.Tensor] = {}
    if weights is None:
        return means, maxima, minima
    units = mask if weights.shape[1] > 1 else mask.any(dim=1, keepdim=True)
    delta = torch.nan_to_num((old_logprobs - sampling_logprobs) * mask, nan=0.0)
    raw = torch.exp(delta if weights.shape[1] > 1 else delta.sum(dim=1, keepdim=True))
    count = units.sum()
    means["grpo/is_weight"] = ((weights * units).sum(), count)
    means["grpo/is_weight_sq"] = ((weights * weights * units).sum(), count)
    means["grpo/is_changed"] = (((weights != raw) & units).sum(), count)
    maxima["grpo/is_weight_max"] = torch.where(units, weights, -math.inf).max()
    minima["grpo/is_weight_min"] = torch.where(units, weights, math.inf).min()
    return means, maxima, minima
