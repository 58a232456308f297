"""Warmup, then an optional stable phase, then decay to a minimum (linear, cosine or sqrt).

With decay_ratio unset the decay spans every step after warmup (classic warmup + decay); with
decay_ratio = r the last r of the steps decay and the ones between stay at the peak (WSD).
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from titanium.config.sections import LRSchedulerSection


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
    progress = (step - decay_start) / decay_steps
    if cfg.decay_type == "linear":
        shape = 1.0 - progress
    elif cfg.decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRSchedulerSection, total_steps: int) -> LambdaLR:
    """A LambdaLR whose internal counter is the number of steps taken so far.

    LambdaLR evaluates the lambda at counter 0 on construction; we shift by one so the LR in
    force during optimizer step k is lr_factor(k).
    """
    return LambdaLR(optimizer, lambda taken: lr_factor(taken + 1, total_steps, cfg))
