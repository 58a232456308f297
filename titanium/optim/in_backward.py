"""Optimizer-in-backward: each parameter is stepped the moment its gradient is complete, and the
gradient is freed at once, so the gradients of the whole model never exist together.

The loop needs no special case: :class:`OptimizerInBackward` is a ``torch.optim.Optimizer`` whose
``param_groups`` are the ones the LR schedule writes (every per-parameter step reads its group's
hyperparameters, the LR included, at the moment it runs), whose ``state`` holds every parameter's
moments (so DCP's ``get/set_optimizer_state_dict(model, optimizer)`` save and load it like any
optimizer), and whose ``step()`` only steps gradients the hooks have not consumed (none in training).

Under FSDP2 the hooks sit on the sharded parameters; FSDP2 calls them after it reduce-scatters each
gradient. Gradient accumulation, global-norm clipping and pipeline parallelism need every gradient
before any step, so they cannot be combined with this (see :func:`check_in_backward`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from titanium.config.loader import ConfigError
from titanium.config.sections import OptimizerSection, TrainingSection

OptimizerFactory = Callable[[list[dict[str, Any]]], Optimizer]
"""Builds an optimizer over the given param groups (the kind the whole model would get)."""


class OptimizerInBackward(Optimizer):
    """One ``make``-built optimizer per parameter, stepped from that parameter's post-accumulate-grad hook.

    The hooks stay on the parameters: build one per model (a second one would step them twice).
    """

    def __init__(self, groups: Iterable[dict[str, Any]], make: OptimizerFactory) -> None:
        self._per_param: dict[torch.Tensor, Optimizer] = {}
        groups = [group for group in groups if group["params"]]
        outer_options = []
        for group in groups:
            options = {k: v for k, v in group.items() if k != "params"}
            for param in group["params"]:
                self._per_param[param] = make([{**options, "params": [param]}])
            # The group as the optimizer class completed it (defaults filled in, an LR the class may have
            # turned into a tensor): the per-parameter groups are then exact copies of their outer group.
            first = self._per_param[group["params"][0]].param_groups[0]
            outer_options.append({k: v for k, v in first.items() if k != "params"})
        defaults = next(iter(self._per_param.values())).defaults
        super().__init__([{**o, "params": g["params"]} for o, g in zip(outer_options, groups, strict=True)], defaults)
        self._group_of = {p: i for i, group in enumerate(self.param_groups) for p in group["params"]}
        self._share_state()
        for param in self._per_param:
            param.register_post_accumulate_grad_hook(self._step_param)

    def _share_state(self) -> None:
        """Every per-parameter optimizer keeps its parameter's state in this optimizer's ``state``
        (each touches only its own key), so saving and loading see one ordinary optimizer state."""
        for optimizer in self._per_param.values():
            optimizer.state = self.state

    def _step_param(self, param: torch.Tensor) -> None:
        optimizer = self._per_param[param]
        group = self.param_groups[self._group_of[param]]
        # The outer group is the truth (the LR schedule and a loaded checkpoint write there).
        optimizer.param_groups[0].update((k, v) for k, v in group.items() if k != "params")
        optimizer.step()
        param.grad = None

    def step(self, closure: Callable[[], float] | None = None) -> None:
        """Step any parameter whose gradient no hook consumed (in training the hooks consumed them all).

        DCP initializes an empty state by setting zero gradients and calling ``step()``; that works
        here as for any optimizer.
        """
        if closure is not None:
            raise ValueError("OptimizerInBackward.step takes no closure: the steps run inside backward")
        for param in self._per_param:
            if param.grad is not None:
                self._step_param(param)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # (replaces self.state: share the new one)
        self._share_state()


def check_in_backward(
    optimizer: OptimizerSection, training: TrainingSection, *, dp_degree: int, pp_degree: int
) -> None:
    """Refuse what cannot work when parameters step during backward (before any process group exists)."""
    if not optimizer.early_step_in_backward:
        return
    flag = "--optimizer.early_step_in_backward"
    one_step_batch = training.local_batch_size * dp_degree
    if training.global_batch_size not in (-1, one_step_batch):
        raise ConfigError(
            f"{flag} steps each parameter in its backward, so a step must be one microbatch per rank: "
            f"--training.global_batch_size {training.global_batch_size} asks for gradient accumulation; set it "
            f"to -1 (= local_batch_size x data-parallel degree = {one_step_batch}), or raise "
            "--training.local_batch_size instead"
        )
    if training.max_norm > 0:
        raise ConfigError(
            f"{flag} cannot clip the global gradient norm (no step sees all gradients); "
            f"set --training.max_norm 0 (it is {training.max_norm})"
        )
    if pp_degree > 1:
        raise ConfigError(
            f"{flag} does not work with --parallelism.pipeline_parallel_degree {pp_degree}: a pipeline stage "
            "accumulates gradients over its microbatches before they are complete; use FSDP/TP instead"
        )
