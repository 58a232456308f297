"""Auxiliary loss terms from inside the model (e.g. MoE load balancing), under the loop's loss rule.

A module adds a term while the loop runs a step: ``hidden = add_aux_loss(hidden, term)`` returns ``hidden``
unchanged and, in the backward, gives ``term`` the gradient it would get had it been added to the microbatch's
loss sum: ``1 / (global loss units of the step)``, the same divisor as the objective's loss. So ``term`` must be a
sum over this microbatch's loss units (for token objectives: a sum over its tokens), and gradient accumulation,
data parallelism and pipeline stages all give the gradient of ``(sum of losses + sum of terms) / units``. The
term travels with the activations, so a pipeline stage that holds no loss adds its own. The loop adds the terms'
values to the logged loss.

Outside a step (evaluation, generation, a frozen model without a scope) ``add_aux_loss`` does nothing. Nothing
here knows about parallelism: the executor opens the scope (``AUX_LOSSES.scope``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class _AttachTerm(torch.autograd.Function):
    """Identity on ``hidden``; in the backward, ``term`` gets ``scale`` (d loss / d term)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, term: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        ctx.term_shape = term.shape
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (scale,) = ctx.saved_tensors
        return grad, scale.expand(ctx.term_shape).to(scale.dtype), None


class AuxLosses:
    """The step's auxiliary terms: the gradient scale while a step runs, and the sum of the terms' values."""

    def __init__(self) -> None:
        self.active = False
        self.scale = torch.zeros(())
        self.total = torch.zeros(())

    @contextlib.contextmanager
    def scope(self, units: torch.Tensor) -> Iterator[AuxLosses]:
        """While a step's forward and backward run: terms are divided by ``units`` (the step's global loss units);
        ``total`` collects their values (detached) for the logged loss."""
        self.scale = 1.0 / units.clamp(min=1).float()
        self.total = torch.zeros((), device=units.device)
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    def add(self, hidden: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
        if not self.active or term.device.type == "meta":  # (a pipeline schedule's shape inference)
            return hidden
        if torch._C._current_graph_task_id() == -1:  # (not an activation-checkpoint recompute in the backward)
            self.total = self.total + term.detach().float()
        if not (torch.is_grad_enabled() and term.requires_grad):
            return hidden
        return _AttachTerm.apply(hidden, term, self.scale.to(term.dtype))


AUX_LOSSES = AuxLosses()


def add_aux_loss(hidden: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
    """``hidden``, carrying ``term`` (a 0-d sum over this microbatch's loss units) into the step's loss."""
    return AUX_LOSSES.add(hidden, term)
