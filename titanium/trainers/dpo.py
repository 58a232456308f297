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
from torch.distributed.tensor import DTensor

from titanium.config.sections import DPOSection
from titanium.trainers.base import IGNORE_INDEX

METRICS = ("reward_chosen", "reward_rejected", "margin", "accuracy", "logp_chosen", "logp_rejected")
"""The per-pair metrics (sums over pairs in DPOLoss; ``dpo/<name>`` means on the log line)."""


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) at every position in float32, [batch, seq]; 0 where the label is IGNORE_INDEX.

    Under loss parallel (tensor parallelism) ``logits`` is vocabulary-sharded: the cross-entropy runs on
    the shards and only the [batch, seq] result is made whole.
    """
    flat = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX)
    if isinstance(flat, DTensor):
        flat = flat.full_tensor()
    return -flat.view(labels.shape)


def response_sums(values: torch.Tensor, response_ids: torch.Tensor, slots: int) -> torch.Tensor:
    """Per-pair sums of per-token ``values`` [..., rows, seq] over each response's labels: [..., pairs, 2].

    ``response_ids`` [rows, seq] is the batch's (titanium.data.preference_batch): ``2m + side`` for the
    m-th pair of a row pair, -1 where there is no label. Pair ``g * slots + m`` is the m-th pair of row pair
    g; column 0 is its chosen response, 1 its rejected one; a slot without a pair sums to 0. Padded and
    packed rows, and any run of whole row pairs, sum the same way. Under context parallelism each rank
    sums its part of the sequences; the caller adds the parts over the cp group before any non-linearity.
    """
    rows, seq = response_ids.shape
    ids = response_ids.reshape(rows // 2, 2 * seq)
    index = ids.clamp(min=0).expand(*values.shape[:-2], -1, -1)
    masked = torch.where(ids >= 0, values.reshape(*values.shape[:-2], rows // 2, 2 * seq), 0.0)
    sums = values.new_zeros(*values.shape[:-2], rows // 2, 2 * slots).scatter_add(-1, index, masked)
    return sums.view(*values.shape[:-2], rows // 2 * slots, 2)


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
    mask: torch.Tensor | None = None,
) -> DPOLoss:
    """The loss of every pair from summed response log-probs ([pairs] each; see the module docstring).

    ``chosen_lengths``/``rejected_lengths`` (label tokens per response) are needed with length_normalize
    and with rpo_alpha > 0. The reference log-probs are treated as constants. ``mask`` (bool, [pairs])
    says which entries are pairs: the others (empty slots of a batch layout) get loss 0 and no metrics.
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
    weight = torch.ones_like(h) if mask is None else mask.to(h.dtype)
    chosen_rewards, rejected_rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    per_pair = {
        "reward_chosen": chosen_rewards,
        "reward_rejected": rejected_rewards,
        "margin": chosen_rewards - rejected_rewards,
        "accuracy": (chosen_rewards > rejected_rewards).to(h.dtype),
        "logp_chosen": policy_chosen.detach(),
        "logp_rejected": policy_rejected.detach(),
    }
    return DPOLoss(losses * weight, {name: (value * weight).sum() for name, value in per_pair.items()})
