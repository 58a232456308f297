"""Test-only objectives that go wrong at one step (not shipped): pretraining whose step-3 loss is poisoned.

The k-th microbatch this instance hands out (k counts from 1 and is part of the checkpointed state, so a
validation pass, which restarts its own instance, never reaches it) carries a ``fault`` flag on data-parallel
rank 0 only: the other ranks' losses stay finite, so the loop must spread the decision itself. With one
microbatch per step (the tests' setting) the faulty microbatch is step FAULT_STEP's.

- ``NanLoss``: a NaN is added to the loss as a constant: the loss is NaN, the gradients stay finite (only a check
  of the loss catches it).
- ``NanGrad``: the loss is finite, its gradient NaN (only a check of the gradient norm catches it).
- ``LossSpike``: the loss (and gradient) is 20 times larger.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from titanium.batch import Batch
from titanium.objectives.base import LossResult, ModelOutput
from titanium.objectives.losses.cross_entropy import TokenFields
from titanium.objectives.pretrain import PretrainObjective

FAULT_STEP = 3


class _NanGradient(torch.autograd.Function):
    """Identity forward; a NaN gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


@dataclass
class FaultFields(TokenFields):
    fault: torch.Tensor | None = None
    """A 0-d flag (kept whole): this microbatch's loss goes wrong."""


class _Faulty(PretrainObjective):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dp_rank = args[0].dp_rank
        self.handed_out = 0

    def next_microbatch(self) -> Batch:
        batch = super().next_microbatch()
        self.handed_out += 1
        fault = torch.tensor(float(self.handed_out == FAULT_STEP and self.dp_rank == 0))
        return dataclasses.replace(batch, fields=FaultFields(batch.fields.labels, fault=fault))

    def loss(self, output: ModelOutput, batch: Batch[FaultFields]) -> LossResult:
        loss = super().loss(output, batch).loss_sum
        return LossResult(self.fault(loss) if batch.fields.fault.item() else loss)  # (a test may sync)

    def fault(self, loss: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "handed_out": self.handed_out}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.handed_out = state.pop("handed_out")
        super().load_state_dict(state)


class NanLoss(_Faulty):
    def fault(self, loss: torch.Tensor) -> torch.Tensor:
        return loss + float("nan")  # d(loss + c)/d(loss) = 1: finite gradients


class NanGrad(_Faulty):
    def fault(self, loss: torch.Tensor) -> torch.Tensor:
        return _NanGradient.apply(loss)


class LossSpike(_Faulty):
    def fault(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * 20


class UnscaledLossSpike(LossSpike):
    """LossSpike from an objective that declares its loss spikes meaningless (as GRPO's loss near 0)."""

    loss_spikes = False
