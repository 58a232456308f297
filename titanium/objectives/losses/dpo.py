"""The per-pair losses behind ``--dpo.loss_type`` (registered in titanium/config/components.py's DPO_LOSSES).

A loss is called ``fn(chosen, rejected, dpo_section)`` with each side's score, [pairs] each, and returns the
per-pair losses. For a loss that needs the reference (a plain function, or ``PairLoss(..., reference=True)``)
the scores are the log-ratios rho = log pi(y|x) - log pi_ref(y|x) (summed over the response, or averaged with
``length_normalize``); for a reference-free one (``PairLoss(..., reference=False)``: SimPO, ORPO) they are the
policy's mean token log-probs, and no reference model is built. The implicit rewards logged are beta x the
scores either way. The formulas and TRL's equality are in titanium/objectives/losses/preference.py (and its
tests); the functions here only adapt them to this signature.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from titanium.config.sections import DPOSection
from titanium.objectives.losses import preference as pl

PairResult = torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]
"""Per-pair losses, optionally with loss-specific per-pair values (detached) logged as means."""


@dataclass(frozen=True)
class PairLoss:
    """A preference loss with what it needs besides its function."""

    fn: Callable[[torch.Tensor, torch.Tensor, DPOSection], PairResult]
    reference: bool = True
    """False: the scores are mean token log-probs of the policy alone; no reference model is built."""
    metrics: tuple[str, ...] = ()
    """The names of the extra per-pair values ``fn`` returns (logged as ``dpo/<name>``)."""
    nll_weight: Callable[[DPOSection], float] = lambda cfg: 0.0
    """Weight of the chosen sequences' token-mean NLL added to the loss (CPO-SimPO's cpo_alpha, ORPO's 1)."""
    nll_over_prompt: bool = False
    """The NLL counts the chosen sequence's prompt tokens too (ORPO), not only its response."""

    def __call__(
        self, chosen: torch.Tensor, rejected: torch.Tensor, cfg: DPOSection
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        result = self.fn(chosen, rejected, cfg)
        return result if isinstance(result, tuple) else (result, {})


def as_pair_loss(loss: PairLoss | Callable[[torch.Tensor, torch.Tensor, DPOSection], PairResult]) -> PairLoss:
    """A registered or imported loss as a PairLoss (a plain function is a loss on log-ratios)."""
    return loss if isinstance(loss, PairLoss) else PairLoss(loss)


def sigmoid_loss(chosen: torch.Tensor, rejected: torch.Tensor, cfg: DPOSection) -> torch.Tensor:
    """DPO (with label smoothing e: conservative DPO)."""
    eps, h = cfg.label_smoothing, cfg.beta * (chosen - rejected)
    return -(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)


def ipo_loss(chosen: torch.Tensor, rejected: torch.Tensor, cfg: DPOSection) -> torch.Tensor:
    return (chosen - rejected - 1 / (2 * cfg.beta)) ** 2


def hinge_loss(chosen: torch.Tensor, rejected: torch.Tensor, cfg: DPOSection) -> torch.Tensor:
    """SLiC."""
    return torch.relu(1 - cfg.beta * (chosen - rejected))


def robust_loss(chosen: torch.Tensor, rejected: torch.Tensor, cfg: DPOSection) -> torch.Tensor:
    """Robust DPO (the log-ratios stand in for the policy's log-probs, with a reference of 0)."""
    zero = torch.zeros_like(chosen)
    return pl.robust_dpo_loss(chosen, rejected, zero, zero, cfg.beta, cfg.label_smoothing).losses


def bco_pair_loss(chosen: torch.Tensor, rejected: torch.Tensor, cfg: DPOSection) -> torch.Tensor:
    zero = torch.zeros_like(chosen)
    return pl.bco_pair_loss(chosen, rejected, zero, zero, cfg.beta).losses


def _simpo(chosen: torch.Tensor, rejected: torch.Tensor, cfg: DPOSection) -> torch.Tensor:
    one = torch.ones_like(chosen)  # (the scores are already mean log-probs)
    return pl.simpo_loss(chosen, rejected, one, one, cfg.beta, cfg.simpo_gamma, cfg.label_smoothing).losses


def _orpo(chosen: torch.Tensor, rejected: torch.Tensor, cfg: DPOSection) -> PairResult:
    one = torch.ones_like(chosen)
    out = pl.orpo_loss(chosen, rejected, one, one, cfg.beta)
    return out.losses, out.extra


SIMPO = PairLoss(_simpo, reference=False, nll_weight=lambda cfg: cfg.cpo_alpha)
"""SimPO; with cpo_alpha > 0, CPO-SimPO (TRL's CPOTrainer, whose default cpo_alpha is 1.0)."""
ORPO = PairLoss(
    _orpo,
    reference=False,
    metrics=("log_odds_ratio", "log_odds_chosen"),
    nll_weight=lambda cfg: 1.0,
    nll_over_prompt=True,
)
"""ORPO: the odds-ratio term plus the NLL of the chosen sequences, prompt included (TRL's ORPOTrainer)."""
