"""Warmup, then an optional stable phase, then decay to a minimum (linear, cosine or sqrt).

With decay_ratio unset the decay spans every step after warmup (classic warmup + decay); with
decay_ratio = r the last r of the steps decay and the ones between stay at the peak (WSD).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from titanium.config.sections import LRSchedulerSection

logger = logging.getLogger(__name__)


def lr_factor(step: int, total_steps: int, cfg: LRSchedulerSection) -> float:
    """Multiplier of the peak LR for optimizer step `step` (1-based: the first update is step 1)."""
    warmup = min(cfg.warmup_steps, total_steps)
    if step <= warmup:
        # (step / (warmup + 1)) never hands the first update an LR of exactly zero.
        return step / (warmup + 1)
    decay_steps = total_steps - warmup if cfg.decay_ratio is None else round(total_steps * cfg.decay_ratio)
    decay_start = total_steps - decay_steps
    if step <= decay_start or decay_steps == 0:
        return 1.0
    progress = min((step - decay_start) / decay_steps, 1.0)  # past the end: the minimum, never below it
    if cfg.decay_type == "linear":
        shape = 1.0 - progress
    elif cfg.decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * shape


class ScheduledLR(LambdaLR):
    """A LambdaLR whose internal counter is the number of steps taken so far, and whose LR after a resume comes
    from this run's schedule: never from the LR the checkpoint's optimizer held (computed by the old schedule, it
    is stale when ``--training.steps`` or ``--optimizer.lr`` changed), nor from the saved peak.

    LambdaLR evaluates the lambda at counter 0 on construction; the lambda is shifted by one so the LR in force
    during optimizer step k is lr_factor(k)."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: LRSchedulerSection, total_steps: int) -> None:
        self.total_steps = total_steps  # (saved with the state: a resume can tell that the schedule changed)
        super().__init__(optimizer, lambda taken: lr_factor(taken + 1, total_steps, cfg))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        total, peaks = self.total_steps, list(self.base_lrs)
        saved_total = state_dict.get("total_steps", total)
        super().load_state_dict(state_dict)
        self.total_steps, self.base_lrs = total, peaks
        self._last_lr = [peak * self.lr_lambdas[0](self.last_epoch) for peak in peaks]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # (a tensor LR is read in place by the fused step)
            else:
                group["lr"] = lr
        if saved_total != total and self.last_epoch >= saved_total:
            logger.warning(
                "the resumed run had finished its %d-step LR schedule; with --training.steps %d the schedule is "
                "recomputed over %d steps, so the LR of step %d is %.3g (pass the old --training.steps and "
                "--lr_scheduler.* values to keep the old schedule's minimum)",
                saved_total, total, total, self.last_epoch + 1, self._last_lr[0],
            )  # fmt: skip


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRSchedulerSection, total_steps: int) -> ScheduledLR:
    """The run's LR schedule over ``total_steps`` optimizer steps (see ScheduledLR)."""
    return ScheduledLR(optimizer, cfg, total_steps)
