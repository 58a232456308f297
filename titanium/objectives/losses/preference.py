"""Reference-free and unpaired preference losses: SimPO, ORPO, KTO, and the robust and BCO variants of DPO.

Every function works on per-sequence log-probs: ``log pi(y|x)`` summed over the response's label tokens, with
the number of those tokens beside it where a formula averages (SimPO, ORPO), so the averages are exact for
padded and packed layouts alike. Each returns the loss of every example (pair or unpaired response), to be
summed by the caller: divided by the example count, that sum is TRL's micro-batch mean. Terms that TRL takes
as one token mean over the whole batch (the SFT / behaviour-cloning NLL of ORPO and CPO-SimPO) come from
``token_mean_nll`` and are added on top. Rewards are returned detached, for the metrics TRL logs
(``rewards/chosen`` and friends). Defaults are those of TRL 1.16's configs; titanium's tests check each loss
and its gradients against TRL's own trainer code on the same log-probs.

Notation: ``pi_c``, ``pi_r`` the policy's summed log-probs of the chosen / rejected response; ``n_c``, ``n_r``
their token counts (clamped to >= 1); ``ref_*`` the frozen reference's (treated as constants);
``rho = pi - ref`` a log-ratio; ``sigma`` the logistic function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PreferenceLoss:
    """The per-pair result of a paired preference loss."""

    losses: torch.Tensor
    """[pairs] per-pair losses (with gradient); sum them and divide by the pair count for TRL's mean."""
    chosen_rewards: torch.Tensor
    """[pairs] the implicit reward of each chosen response (detached); TRL's ``rewards/chosen`` is their mean."""
    rejected_rewards: torch.Tensor
    """[pairs] the same for the rejected responses (``rewards/rejected``)."""
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    """[pairs] loss-specific per-pair values (detached) whose means TRL logs under these names."""


@dataclass
class UnpairedLoss:
    """The per-example result of an unpaired preference loss (KTO)."""

    losses: torch.Tensor
    """[examples] weighted per-example losses (with gradient); TRL's loss is their mean over the batch."""
    rewards: torch.Tensor
    """[examples] beta x log-ratio (detached); TRL's ``rewards/chosen`` / ``rewards/rejected`` are the means over
    the desirable / undesirable examples."""


def mean_logps(logps: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per-token average log-probs: summed log-probs divided by the token count (clamped to >= 1, so an empty
    slot gives 0 rather than NaN)."""
    return logps / lengths.clamp(min=1)


def token_mean_nll(logps: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """One token-mean negative log-likelihood over a whole batch: -sum(logps) / sum(lengths), a 0-d tensor.

    This is TRL's SFT term (``nn.CrossEntropyLoss`` over every label token of the batch's chosen sequences):
    CPO/SimPO's ``cpo_alpha`` term over the chosen responses' tokens, and ORPO's NLL over the chosen prompt
    *and* response tokens (every attended token after the first). Long responses weigh more than short ones,
    unlike a mean of per-sequence means.
    """
    return -logps.sum() / lengths.sum().clamp(min=1)


def _smoothed_logistic(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-(1 - e) log sigma(z) - e log sigma(-z): the logistic loss with the label flipped with probability e."""
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def simpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    beta: float = 0.1,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> PreferenceLoss:
    """SimPO (Meng et al. 2024): reference-free, length-normalized, with a target reward margin.

    With m_c = pi_c / n_c and m_r = pi_r / n_r (average log-probs) and z = beta (m_c - m_r) - gamma, the loss
    of a pair is -(1 - e) log sigma(z) - e log sigma(-z) (e = ``label_smoothing``, 0 for the paper's loss);
    the rewards are beta m_c and beta m_r.

    Defaults are TRL's ``CPOConfig`` (``loss_type="simpo"``): beta 0.1, ``simpo_gamma`` 0.5, label smoothing 0.
    TRL's ``cpo_alpha`` defaults to 1.0, which adds ``cpo_alpha x token_mean_nll`` of the chosen responses
    (CPO-SimPO); the paper's pure SimPO is ``cpo_alpha=0``. The SimPO paper tunes beta in [2, 2.5] with
    gamma / beta in [0.3, 0.8] (e.g. beta 2.0, gamma 1.0); TRL takes gamma itself, not the ratio.
    """
    chosen, rejected = mean_logps(chosen_logps, chosen_lengths), mean_logps(rejected_logps, rejected_lengths)
    losses = _smoothed_logistic(beta * (chosen - rejected) - gamma, label_smoothing)
    return PreferenceLoss(losses, beta * chosen.detach(), beta * rejected.detach())


def _log1m_exp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler 2012: expm1 near 0, log1p far from it)."""
    near_zero = x > -math.log(2)
    return torch.where(near_zero, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    beta: float = 0.1,
) -> PreferenceLoss:
    """ORPO's odds-ratio term (Hong et al. 2024): reference-free, on average log-probs.

    With m = pi / n (average log-prob, < 0) and odds(y) = p / (1 - p) in log space,
    log_odds = (m_c - m_r) - (log(1 - exp m_c) - log(1 - exp m_r)), the per-pair term is
    -beta log sigma(log_odds). The full ORPO loss of a batch is ``token_mean_nll`` of the chosen sequences
    (over their prompt and response tokens, as TRL computes it) plus the mean of these terms. Rewards are
    beta m_c and beta m_r; ``extra`` holds ``log_odds_ratio`` = log sigma(log_odds) and ``log_odds_chosen`` =
    log_odds, whose batch means TRL logs under those names.

    Default: TRL's ``ORPOConfig`` beta 0.1 (the paper's lambda).
    """
    chosen, rejected = mean_logps(chosen_logps, chosen_lengths), mean_logps(rejected_logps, rejected_lengths)
    log_odds = (chosen - rejected) - (_log1m_exp(chosen) - _log1m_exp(rejected))
    ratio = F.logsigmoid(log_odds)
    extra = {"log_odds_ratio": ratio.detach(), "log_odds_chosen": log_odds.detach()}
    return PreferenceLoss(-beta * ratio, beta * chosen.detach(), beta * rejected.detach(), extra)


def _log_ratios(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    return policy_chosen - reference_chosen.detach(), policy_rejected - reference_rejected.detach()


def robust_dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> PreferenceLoss:
    """Robust DPO (Chowdhury et al. 2024): DPO made unbiased under labels flipped with probability e.

    With h = rho_c - rho_r (summed log-probs), the loss of a pair is
    [-(1 - e) log sigma(beta h) + e log sigma(-beta h)] / (1 - 2e), e = ``label_smoothing`` in [0, 0.5)
    (e = 0 is plain DPO). Note the + sign: unlike conservative DPO it is not a smoothed logistic loss.
    Rewards are beta rho_c and beta rho_r. Defaults: TRL's ``DPOConfig`` beta 0.1, label smoothing 0.0
    (the paper uses 0.1); TRL's default f-divergence (reverse KL, scores = log-ratios) is the one here.
    """
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"robust DPO needs label_smoothing in [0, 0.5), got {label_smoothing}")
    chosen, rejected = _log_ratios(policy_chosen, policy_rejected, reference_chosen, reference_rejected)
    z = beta * (chosen - rejected)
    e = label_smoothing
    losses = (-(1 - e) * F.logsigmoid(z) + e * F.logsigmoid(-z)) / (1 - 2 * e)
    return PreferenceLoss(losses, beta * chosen.detach(), beta * rejected.detach())


def bco_pair_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float = 0.1,
) -> PreferenceLoss:
    """BCO on pairs (Jung et al. 2024, TRL's ``bco_pair``): each response classified on its own reward.

    The loss of a pair is -log sigma(beta rho_c) - log sigma(-beta rho_r) (summed log-probs): the chosen
    response's reward pushed up, the rejected one's down, each against 0. TRL's DPO version has no running
    reward-mean shift (the paper's delta), so neither has this. Rewards are beta rho_c and beta rho_r.
    Default: TRL's ``DPOConfig`` beta 0.1.
    """
    chosen, rejected = _log_ratios(policy_chosen, policy_rejected, reference_chosen, reference_rejected)
    chosen_rewards, rejected_rewards = beta * chosen, beta * rejected
    losses = -F.logsigmoid(chosen_rewards) - F.logsigmoid(-rejected_rewards)
    return PreferenceLoss(losses, chosen_rewards.detach(), rejected_rewards.detach())


def kto_kl_estimate(policy_kl_logps: torch.Tensor, reference_kl_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point z_0: the mean log-ratio of mismatched (prompt, completion) pairs, detached (0-d).

    The mismatched pairs are the batch's own completions rotated by one over its prompts, (x_i, y_{i-1}), as
    TRL builds them; their summed completion log-probs under the policy and the reference come in here. No
    gradient flows through the estimate. Under data parallelism, average this local mean over the ranks (TRL:
    the mean of the per-process means) before ``kto_loss``, which clamps it at 0.
    """
    return (policy_kl_logps - reference_kl_logps.detach()).mean().detach()


KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
"""TRL's ``KTOConfig.loss_type`` choices."""


def kto_loss(
    policy_logps: torch.Tensor,
    reference_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor | None,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
) -> UnpairedLoss:
    """KTO (Ethayarajh et al. 2024, eq. 7) on unpaired responses, each labelled desirable or not.

    With rho = pi - ref (summed completion log-probs) and z_0 = max(kl, 0) (``kto_kl_estimate``, constant),
    a desirable response's loss is w_d (1 - sigma(beta (rho - z_0))) and an undesirable one's
    w_u (1 - sigma(beta (z_0 - rho))). ``loss_type="apo_zero_unpaired"`` (APO-zero, D'Oosterlinck et al.
    2024) drops z_0: w_d (1 - sigma(beta rho)) and w_u sigma(beta rho); it needs no ``kl``. TRL's loss is the
    mean over all examples of the batch, desirable or not; a batch of only one kind is fine.

    ``desirable`` is bool [examples]. Defaults: TRL's ``KTOConfig`` beta 0.1, ``desirable_weight`` 1.0,
    ``undesirable_weight`` 1.0 (TRL suggests weights with w_d n_d / (w_u n_u) in [1, 4/3]).
    """
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"unknown KTO loss_type {loss_type!r}; expected one of {', '.join(KTO_LOSS_TYPES)}")
    rho = policy_logps - reference_logps.detach()
    if loss_type == "kto":
        if kl is None:
            raise ValueError("the kto loss needs the KL estimate (kto_kl_estimate of the mismatched pairs)")
        z0 = kl.detach().clamp(min=0)
        desirable_losses = 1 - torch.sigmoid(beta * (rho - z0))
        undesirable_losses = 1 - torch.sigmoid(beta * (z0 - rho))
    else:
        desirable_losses = 1 - torch.sigmoid(beta * rho)
        undesirable_losses = torch.sigmoid(beta * rho)
    losses = torch.where(desirable, desirable_weight * desirable_losses, undesirable_weight * undesirable_losses)
    return UnpairedLoss(losses, beta * rho.detach())
