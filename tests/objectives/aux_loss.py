"""``python -m tests.objectives.aux_loss <titanium.train args>``: training with a test-only converter that adds an
auxiliary loss term from inside the model (not shipped).

``ActivationPenalty`` makes every decoder block add ``coef x sum over its tokens of mean(h^2)`` of its output
through ``add_aux_loss``, as an MoE router adds its load-balancing term: on any pipeline stage, with nothing in
the loop or the objective knowing. It is registered as a converter with its own section ([activation_penalty]
coef; 0: off) before the job config is read, the way code outside titanium adds a component.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

from titanium.config.components import CONVERTERS
from titanium.config.registry import SectionSpec
from titanium.models.common.aux_loss import add_aux_loss
from titanium.models.converter import ConverterContext, ModelConverter


@dataclass
class ActivationPenaltySection:
    coef: float = 0.0
    """Weight of each block's squared-activation term; 0 turns the converter off."""


class _Penalized:
    """Mixin: a decoder block whose output carries its auxiliary term."""

    aux_coef: float

    def forward(self, x: torch.Tensor, inputs) -> torch.Tensor:
        h = super().forward(x, inputs)
        return add_aux_loss(h, self.aux_coef * h.float().pow(2).mean(dim=-1).sum())


class ActivationPenalty(ModelConverter):
    name = "activation_penalty"

    def __init__(self, coef: float) -> None:
        self.coef = coef

    @classmethod
    def from_config(cls, section: ActivationPenaltySection, ctx: ConverterContext) -> ActivationPenalty | None:
        return cls(section.coef) if section.coef > 0 else None

    def convert(self, model: nn.Module) -> None:
        for block in model.layers.values():
            block.__class__ = type(f"Penalized{type(block).__name__}", (_Penalized, type(block)), {})
            block.aux_coef = self.coef


def register() -> None:
    CONVERTERS.register(
        "activation_penalty",
        "tests.objectives.aux_loss:ActivationPenalty",
        SectionSpec("activation_penalty", ActivationPenaltySection),
    )


if __name__ == "__main__":
    from titanium.train import main

    register()
    sys.exit(main())
