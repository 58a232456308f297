"""The reward-modelling loss: Bradley-Terry on the scalar scores of preference pairs.

For a pair with chosen score ``r_c`` and rejected score ``r_r`` (each the reward model's score at the sequence's
last non-pad token, titanium.models.reward.sequence_scores):

    loss = -log sigma(r_c - r_r - m) + c * (r_c + r_r)^2

with ``m`` the pair's optional margin (how much more the chosen response is preferred, e.g. from a rating gap;
Llama 2's reward models) and ``c`` the optional centering coefficient (Eisenstein et al. 2023: it pulls the
scores towards zero mean, since Bradley-Terry sees only their differences). TRL's ``RewardTrainer`` takes the
mean of the first term over the micro-batch plus ``c`` times the mean of ``(r_c + r_r)^2``: both are means
over the same pairs, so the per-pair sum above, summed and divided by the pair count, is TRL's loss, and the
loop's rule (a sum over loss units divided by their global count) gives the exact mean over every pair of the
step. The unit is a pair.

Metrics, as sums over the pairs (divide by the pair count): ``accuracy`` (r_c > r_r, TRL's ``accuracy``),
``margin`` (r_c - r_r, without the margin term; TRL's ``margin``) and the two scores (their mean over both is
TRL's ``mean_reward``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

METRICS = ("accuracy", "margin", "reward_chosen", "reward_rejected")


@dataclass
class RewardLoss:
    loss_sum: torch.Tensor
    """Sum of the per-pair losses (0-d, with gradient); the loop divides it by the global pair count."""
    pairs: torch.Tensor
    """The number of pairs (0-d integer tensor): the loss units."""
    metrics: dict[str, torch.Tensor]
    """``METRICS`` -> sum over the pairs (detached 0-d tensors); divide by the pair count for means."""


def reward_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float | None = None,
    mask: torch.Tensor | None = None,
) -> RewardLoss:
    """The Bradley-Terry loss of the pairs with scores ``chosen`` and ``rejected`` ([pairs] each).

    ``margin`` ([pairs]) is subtracted from each score difference; ``center_rewards_coefficient`` (None or 0:
    off) adds ``c * (r_c + r_r)^2`` per pair. ``mask`` (bool, [pairs]) says which entries are pairs: the others
    (empty slots of a batch layout) count for nothing.
    """
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(f"chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} must be [pairs] each")
    difference = chosen - rejected
    losses = -F.logsigmoid(difference if margin is None else difference - margin.to(difference.dtype))
    if center_rewards_coefficient:
        losses = losses + center_rewards_coefficient * (chosen + rejected) ** 2
    weight = torch.ones_like(difference) if mask is None else mask.to(difference.dtype)
    chosen, rejected, difference = chosen.detach(), rejected.detach(), difference.detach()
    per_pair = {
        "accuracy": (chosen > rejected).to(difference.dtype),
        "margin": difference,
        "reward_chosen": chosen,
        "reward_rejected": rejected,
    }
    return RewardLoss(
        loss_sum=(losses * weight).sum(),
        pairs=weight.sum().to(torch.long),
        metrics={name: (value * weight).sum() for name, value in per_pair.items()},
    )
