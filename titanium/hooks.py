"""Points in the loop where features hook in without the loop knowing them.

Whoever owns a feature registers at setup: the model builder for the policy's converters (float8 scale
precompute after the optimizer step, a LoRA adapter export), a policy handle for whoever follows the policy's
weights (``PolicyHandle.on_update``: a rollout engine's weight sync), and the components registered in
``titanium.config.components.TRAINING_HOOKS`` with their own config sections (``[moe]``: the MoE load-balancing
loss, router-bias update and load metrics). The loop calls each hook at its point, in registration order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
R = TypeVar("R")


class Hook(Generic[T, R]):
    """Functions called with one argument (``T``) at one point of the loop; the call returns their results."""

    def __init__(self) -> None:
        self._functions: list[Callable[[T], R]] = []

    def register(self, function: Callable[[T], R]) -> Callable[[T], R]:
        self._functions.append(function)
        return function

    def __call__(self, value: T) -> list[R]:
        return [function(value) for function in self._functions]

    def __len__(self) -> int:
        return len(self._functions)

    def __iter__(self) -> Iterator[Callable[[T], R]]:
        return iter(self._functions)


@dataclass
class TrainingHooks:
    after_optimizer_step: Hook[int, None] = field(default_factory=Hook)
    """After every optimizer step (and its LR step), with the number of the step just taken: the weights changed."""
    after_load: Hook[int, None] = field(default_factory=Hook)
    """Once the starting state is in place (a resumed checkpoint, or the starting weights), with its step (0 for a
    fresh start)."""
    loss_term: Hook[Any, torch.Tensor | None] = field(default_factory=Hook)
    """After each training microbatch's forward (with the microbatch, a ``titanium.batch.Batch``), before its
    backward: a term to add to that microbatch's share of the step's loss (already divided as it should count), or
    None; e.g. the MoE load-balancing loss. Not called for forward-only passes (validation). The pipeline executor
    refuses these (a stage's forward holds only its own layers): their owners refuse pipeline parallelism."""
    metrics: Hook[int, dict[str, float]] = field(default_factory=Hook)
    """On logging steps (every rank together, with the step): numbers to log, the same on every rank."""
    export: Hook[Any, None] = field(default_factory=Hook)
    """At the end of training, with the run's ``titanium.models.converter.ExportContext``: write artifacts."""


@dataclass(frozen=True)
class HookContext:
    """What a component registering loop hooks (``TRAINING_HOOKS``) may use of the run, besides its own section."""

    built: Any
    """The policy as built (a ``titanium.model_builder.BuiltModel``: its model, args, spec, pipeline group)."""
    microbatches: int
    """Microbatches per optimizer step on each rank (gradient accumulation)."""
    loss_group: dist.ProcessGroup
    """The ranks whose loss units add up (data and context parallel)."""
    hf_export: bool
    """The run ends with a Hugging Face export ([checkpoint] last_save_in_hf)."""
