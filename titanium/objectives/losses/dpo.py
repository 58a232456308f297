"""DPO's loss in one place: ``dpo_loss`` (scores, length normalisation, RPO's NLL term, the logged implicit rewards)
and the per-pair losses behind ``--dpo.loss_type`` (registered in titanium/config/components.py's DPO_LOSSES).

A loss is a ``PairLoss``: ``fn(chosen, rejected, beta, knobs)`` with each side's score, [pairs] each, the section's
beta and the loss's own parameters (``knobs``: its dataclass of titanium/config/dpo_losses.py, ``[dpo.<loss_type>]``),
returning the per-pair losses; your own loss by import path is a plain ``fn(chosen, rejected, dpo_section)``. For a
loss that needs the reference (a plain function, or ``PairLoss(..., reference=True)``) the scores are the log-ratios
rho = log pi(y|x) - log pi_ref(y|x) (summed over the response, or averaged with ``length_normalize``); for a
reference-free one (``PairLoss(..., reference=False)``: SimPO, ORPO) they are the policy's mean token log-probs, and no
reference model is built. The implicit rewards logged are beta x the scores either way. The formulas and TRL's
equality are in titanium/objectives/losses/preference.py (and its tests); the functions here only adapt them to this
signature.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from titanium.config.dpo_losses import RobustKnobs, SigmoidKnobs, SimPOKnobs
from titanium.config.preference_sections import DPO_LOSSES
from titanium.config.sections import DPOSection
from titanium.objectives.losses import preference as pl

PairResult = torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]
"""Per-pair losses, optionally with loss-specific per-pair values (detached) logged as means."""


@dataclass(frozen=True)
class PairLoss:
    """A preference loss with its own parameters and what else it needs besides its function."""

    fn: Callable[..., PairResult]
    """``fn(chosen, rejected, beta, knobs)``; ``knobs`` None for a loss without parameters of its own."""
    knobs: str = ""
    """The [dpo] key of its parameters (its loss_type: ``[dpo.simpo]``...); "": it reads beta alone."""
    reference: bool = True
    """False: the scores are mean token log-probs of the policy alone; no reference model is built."""
    metrics: tuple[str, ...] = ()
    """The names of the extra per-pair values ``fn`` returns (logged as ``dpo/<name>``)."""
    nll_weight: Callable[[Any], float] = lambda knobs: 0.0
    """Weight, from its knobs, of the chosen sequences' token-mean NLL added to the loss (CPO-SimPO's cpo_alpha,
    ORPO's 1)."""
    nll_over_prompt: bool = False
    """The NLL counts the chosen sequence's prompt tokens too (ORPO), not only its response."""
    whole_section: bool = False
    """Your own plain function, called ``fn(chosen, rejected, dpo_section)``."""

    def parameters(self, cfg: DPOSection) -> Any:
        """Its own parameters in ``cfg`` (None: it has none)."""
        return getattr(cfg, self.knobs) if self.knobs else None

    def weight_of_nll(self, cfg: DPOSection) -> float:
        """``nll_weight`` of its parameters in ``cfg``."""
        return self.nll_weight(self.parameters(cfg))

    def __call__(
        self, chosen: torch.Tensor, rejected: torch.Tensor, cfg: DPOSection
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.whole_section:
            result = self.fn(chosen, rejected, cfg)
        else:
            result = self.fn(chosen, rejected, cfg.beta, self.parameters(cfg))
        return result if isinstance(result, tuple) else (result, {})


def as_pair_loss(loss: PairLoss | Callable[[torch.Tensor, torch.Tensor, DPOSection], PairResult]) -> PairLoss:
    """A registered or imported loss as a PairLoss (a plain function is a loss on log-ratios, handed the whole
    [dpo] section as its parameters)."""
    return loss if isinstance(loss, PairLoss) else PairLoss(loss, whole_section=True)


def _sigmoid(chosen: torch.Tensor, rejected: torch.Tensor, beta: float, knobs: SigmoidKnobs) -> torch.Tensor:
    """DPO (with label smoothing e: conservative DPO)."""
    eps, h = knobs.label_smoothing, beta * (chosen - rejected)
    return -(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)


def _ipo(chosen: torch.Tensor, rejected: torch.Tensor, beta: float, knobs: None) -> torch.Tensor:
    return (chosen - rejected - 1 / (2 * beta)) ** 2


def _hinge(chosen: torch.Tensor, rejected: torch.Tensor, beta: float, knobs: None) -> torch.Tensor:
    """SLiC."""
    return torch.relu(1 - beta * (chosen - rejected))


def _robust(chosen: torch.Tensor, rejected: torch.Tensor, beta: float, knobs: RobustKnobs) -> torch.Tensor:
    """Robust DPO (the log-ratios stand in for the policy's log-probs, with a reference of 0)."""
    zero = torch.zeros_like(chosen)
    return pl.robust_dpo_loss(chosen, rejected, zero, zero, beta, knobs.label_smoothing).losses


def _bco_pair(chosen: torch.Tensor, rejected: torch.Tensor, beta: float, knobs: None) -> torch.Tensor:
    zero = torch.zeros_like(chosen)
    return pl.bco_pair_loss(chosen, rejected, zero, zero, beta).losses


def _simpo(chosen: torch.Tensor, rejected: torch.Tensor, beta: float, knobs: SimPOKnobs) -> torch.Tensor:
    one = torch.ones_like(chosen)  # (the scores are already mean log-probs)
    return pl.simpo_loss(chosen, rejected, one, one, beta, knobs.gamma, knobs.label_smoothing).losses


def _orpo(chosen: torch.Tensor, rejected: torch.Tensor, beta: float, knobs: None) -> PairResult:
    one = torch.ones_like(chosen)
    out = pl.orpo_loss(chosen, rejected, one, one, beta)
    return out.losses, out.extra


SIGMOID = PairLoss(_sigmoid, knobs="sigmoid")
"""DPO; with label_smoothing > 0, conservative DPO."""
IPO = PairLoss(_ipo)
HINGE = PairLoss(_hinge)
ROBUST = PairLoss(_robust, knobs="robust")
BCO_PAIR = PairLoss(_bco_pair)
SIMPO = PairLoss(_simpo, knobs="simpo", reference=False, nll_weight=lambda knobs: knobs.cpo_alpha)
"""SimPO; with cpo_alpha > 0, CPO-SimPO (TRL's CPOTrainer, whose default cpo_alpha is 1.0)."""
ORPO = PairLoss(
    _orpo,
    reference=False,
    metrics=("log_odds_ratio", "log_odds_chosen"),
    nll_weight=lambda knobs: 1.0,
    nll_over_prompt=True,
)
"""ORPO: the odds-ratio term plus the NLL of the chosen sequences, prompt included (TRL's ORPOTrainer)."""


@dataclass
class DPOLoss:
    losses: torch.Tensor
    """[pairs] per-pair losses (with gradient); sum them, the loop divides by the global pair count."""
    metrics: dict[str, torch.Tensor]
    """Sums over the pairs (detached 0-d tensors): divide by the global pair count to report means."""


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor | None,
    reference_rejected: torch.Tensor | None,
    cfg: DPOSection,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> DPOLoss:
    """The loss of every pair from summed response log-probs ([pairs] each; see the module docstring).

    ``chosen_lengths``/``rejected_lengths`` (label tokens per response) are needed with length_normalize,
    with rpo_alpha > 0 and by reference-free losses, whose reference log-probs may be None. The reference
    log-probs are treated as constants. ``mask`` (bool, [pairs]) says which entries are pairs: the others
    (empty slots of a batch layout) get loss 0 and no metrics.
    """
    loss = pair_loss(cfg)
    averaged = cfg.length_normalize or not loss.reference
    if (averaged or cfg.rpo_alpha > 0) and (chosen_lengths is None or rejected_lengths is None):
        raise ValueError("length_normalize, rpo_alpha and reference-free losses need the response lengths")
    chosen, rejected = policy_chosen, policy_rejected
    if loss.reference:
        assert reference_chosen is not None and reference_rejected is not None
        chosen, rejected = chosen - reference_chosen.detach(), rejected - reference_rejected.detach()
    chosen_nll = None
    if chosen_lengths is not None and rejected_lengths is not None:
        chosen_len, rejected_len = chosen_lengths.clamp(min=1), rejected_lengths.clamp(min=1)
        chosen_nll = -policy_chosen / chosen_len
        if averaged:
            chosen, rejected = chosen / chosen_len, rejected / rejected_len
    if mask is not None:  # (an empty slot's mean log-prob, 0, would make ORPO's log(1 - p) infinite)
        chosen, rejected = torch.where(mask, chosen, -1.0), torch.where(mask, rejected, -1.0)
    losses, extra = loss(chosen, rejected, cfg)
    if cfg.rpo_alpha > 0:
        assert chosen_nll is not None
        losses = losses + cfg.rpo_alpha * chosen_nll
    weight = torch.ones_like(chosen) if mask is None else mask.to(chosen.dtype)
    chosen_rewards, rejected_rewards = cfg.beta * chosen.detach(), cfg.beta * rejected.detach()
    per_pair = {
        "reward_chosen": chosen_rewards,
        "reward_rejected": rejected_rewards,
        "margin": chosen_rewards - rejected_rewards,
        "accuracy": (chosen_rewards > rejected_rewards).to(chosen.dtype),
        "logp_chosen": policy_chosen.detach(),
        "logp_rejected": policy_rejected.detach(),
        **extra,
    }
    return DPOLoss(losses * weight, {name: (value * weight).sum() for name, value in per_pair.items()})


def pair_loss(cfg: DPOSection) -> PairLoss:
    """``--dpo.loss_type``'s loss."""
    return as_pair_loss(DPO_LOSSES.load(cfg.loss_type))
