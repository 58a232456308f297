"""The parameters of the DPO losses that have any beyond beta, each loss's own (``[dpo.<loss_type>]``), with its checks.

A loss reads its dataclass, under the ``[dpo]`` key named as its ``loss_type`` (``PairLoss.knobs``,
titanium/objectives/losses/dpo.py); ipo, hinge, bco_pair and orpo read beta alone. TRL's flat names
(``[dpo] label_smoothing``, ``simpo_gamma``, ``cpo_alpha``) still load, moved here with a warning
(titanium/config/moved.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


def _smoothing_problems(where: str, label_smoothing: float) -> Iterator[str]:
    if not 0 <= label_smoothing < 0.5:
        yield f"{where}.label_smoothing must be in [0, 0.5), got {label_smoothing}"


@dataclass
class SigmoidKnobs:
    """--dpo.loss_type sigmoid (DPO)."""

    label_smoothing: float = 0.0
    """The share e of pairs assumed mislabeled, in [0, 0.5): conservative DPO, -(1-e) log sigmoid(beta h) - e log
    sigmoid(-beta h). 0: DPO."""

    def problems(self, where: str) -> Iterator[str]:
        yield from _smoothing_problems(where, self.label_smoothing)


@dataclass
class RobustKnobs:
    """--dpo.loss_type robust (robust DPO)."""

    label_smoothing: float = 0.0
    """The share e of pairs assumed mislabeled, in [0, 0.5), that the loss is made unbiased under (TRL's
    label_smoothing; the paper uses 0.1). 0: DPO."""

    def problems(self, where: str) -> Iterator[str]:
        yield from _smoothing_problems(where, self.label_smoothing)


@dataclass
class SimPOKnobs:
    """--dpo.loss_type simpo (SimPO, CPO-SimPO)."""

    gamma: float = 0.5
    """The target reward margin gamma (TRL's simpo_gamma, default 0.5; the SimPO paper tunes beta in [2, 2.5] with
    gamma / beta in [0.3, 0.8])."""
    cpo_alpha: float = 0.0
    """Weight of the chosen responses' token-mean NLL (CPO-SimPO). 0 is the paper's pure SimPO; TRL's CPOTrainer
    defaults to 1.0 (set 1.0 to match it)."""
    label_smoothing: float = 0.0
    """The share e of pairs assumed mislabeled, in [0, 0.5), as sigmoid's: -(1-e) log sigmoid(z) - e log
    sigmoid(-z)."""

    def problems(self, where: str) -> Iterator[str]:
        yield from _smoothing_problems(where, self.label_smoothing)
        if self.cpo_alpha < 0:
            yield f"{where}.cpo_alpha must be >= 0 (0 turns the NLL term off), got {self.cpo_alpha}"


LOSS_KNOBS = {"sigmoid": SigmoidKnobs, "robust": RobustKnobs, "simpo": SimPOKnobs}
"""loss_type -> its parameters' dataclass, a field of DPOSection under the loss's name."""

FLAT_KNOBS = {"label_smoothing": "label_smoothing", "simpo_gamma": "gamma", "cpo_alpha": "cpo_alpha"}
"""TRL's flat [dpo] name -> the key in the knobs of the losses that read it (``LOSS_KNOBS``)."""
