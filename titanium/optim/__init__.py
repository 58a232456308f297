"""Optimizers (torch AdamW/Adam, torchao low-bit AdamW, optimizer-in-backward) and learning-rate schedules."""

from titanium.optim.in_backward import OptimizerInBackward, check_in_backward
from titanium.optim.lr_schedule import build_lr_scheduler, lr_factor
from titanium.optim.optimizer import build_optimizer, param_groups

__all__ = [
    "OptimizerInBackward",
    "build_lr_scheduler",
    "build_optimizer",
    "check_in_backward",
    "lr_factor",
    "param_groups",
]
