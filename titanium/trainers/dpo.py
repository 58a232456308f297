"""Direct preference optimization: per-response log-probs and the preference losses, as pure functions.

For a pair (prompt x, chosen y_w, rejected y_l), a policy pi and a frozen reference pi_ref, let
h = [log pi(y_w|x) - log pi_ref(y_w|x)] - [log pi(y_l|x) - log pi_ref(y_l|x)], log-probs summed over the
response tokens (or averaged, with length_normalize). The losses per pair are

- sigmoid (DPO, Rafailov et al. 2023): -log sigmoid(beta h); with label smoothing e (conservative DPO),
  -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h);
- ipo (Azar et al. 2023): (h - 1 / (2 beta))^2;
- hinge (SLiC, Zhao et al. 2023): max(0, 1 - beta h);

plus, with rpo_alpha > 0, rpo_alpha times the chosen response's mean token NLL (RPO, Pang et al. 2024).
The implicit rewards are beta x each side's log-ratio. Losses come back per pair, to be summed: the
loop divides by the global number of pairs, so every layout and accumulation gives the exact pair mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from titanium.config.sections import DPOSection
from titanium.trainers.base import IGNORE_INDEX


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) at every position in float32, [batch, seq]; 0 where the label is IGNORE_INDEX."""
    flat = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX)
    return -flat.view(labels.shape)


def response_logps(
    logits: torch.Tensor, labels: torch.Tensor, response_ids: torch.Tensor, n_responses: int
) -> torch.Tensor:
    """Summed label log-probs of each response, [n_responses] float32.

    ``response_ids`` [batch, seq] names the response each label belongs to (-1: none), as the preference
    batches carry it (titanium.data.preference_batch), so padded and packed rows sum the same way. Under
    context parallelism each rank sums its part of the sequence; the caller adds the parts over the cp
    group before any non-linearity.
    """
    logps = token_logps(logits, labels).flatten()
    ids = response_ids.flatten()
    logps = torch.where(ids >= 0, logps, torch.zeros_like(logps))
    return logps.new_zeros(n_responses).index_add(0, ids.clamp(min=0), logps)


@dataclass
class DPOLoss:
    losses: torch.Tensor
    """[pairs] per-pair losses (with gradient); sum them, the loop divides by the global pair count."""
    metrics: dict[str, torch.Tensor]
    """Sums over the pairs (detached 0-d tensors): divide by the global pair count to report means."""


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    cfg: DPOSection,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> DPOLoss:
    """The loss of every pair from summed response log-probs ([pairs] each; see the module docstring).

    ``chosen_lengths``/``rejected_lengths`` (label tokens per response) are needed with length_normalize
    and with rpo_alpha > 0. The reference log-probs are treated as constants.
    """
    if (cfg.length_normalize or cfg.rpo_alpha > 0) and (chosen_lengths is None or rejected_lengths is None):
        raise ValueError("length_normalize and rpo_alpha need the response lengths")
    reference_chosen, reference_rejected = reference_chosen.detach(), reference_rejected.detach()
    chosen_nll = None
    if chosen_lengths is not None and rejected_lengths is not None:
        chosen_len, rejected_len = chosen_lengths.clamp(min=1), rejected_lengths.clamp(min=1)
        chosen_nll = -policy_chosen / chosen_len
        if cfg.length_normalize:
            policy_chosen, reference_chosen = policy_chosen / chosen_len, reference_chosen / chosen_len
            policy_rejected, reference_rejected = policy_rejected / rejected_len, reference_rejected / rejected_len
    chosen_ratio = policy_chosen - reference_chosen
    rejected_ratio = policy_rejected - reference_rejected
    h = chosen_ratio - rejected_ratio
    beta = cfg.beta
    if cfg.loss_type == "sigmoid":
        eps = cfg.label_smoothing
        losses = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    elif cfg.loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif cfg.loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    else:
        raise ValueError(f"unknown --dpo.loss_type {cfg.loss_type!r}; expected sigmoid, ipo or hinge")
    if cfg.rpo_alpha > 0:
        assert chosen_nll is not None
        losses = losses + cfg.rpo_alpha * chosen_nll
    chosen_rewards, rejected_rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    metrics = {
        "rewards/chosen": chosen_rewards.sum(),
        "rewards/rejected": rejected_rewards.sum(),
        "rewards/margin": (chosen_rewards - rejected_rewards).sum(),
        "rewards/accuracy": (chosen_rewards > rejected_rewards).float().sum(),
        "logps/chosen": policy_chosen.detach().sum(),
        "logps/rejected": policy_rejected.detach().sum(),
    }
    return DPOLoss(losses, metrics)
