"""Points in the loop where features hook in without the loop knowing them.

Whoever owns a feature registers at setup: the model builder for the policy's converters (float8 scale
precompute after the optimizer step, a LoRA adapter export) and for the model family (``ModelSpec.training_hooks``,
e.g. MoE router-bias updates), a policy handle for whoever follows the policy's weights (``PolicyHandle.on_update``:
a rollout engine's weight sync). The loop calls each hook at its point, in registration order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Hook(Generic[T]):
    """Functions called with one argument (``T``) at one point of the loop."""

    def __init__(self) -> None:
        self._functions: list[Callable[[T], None]] = []

    def register(self, function: Callable[[T], None]) -> Callable[[T], None]:
        self._functions.append(function)
        return function

    def __call__(self, value: T) -> None:
        for function in self._functions:
            function(value)

    def __len__(self) -> int:
        return len(self._functions)


@dataclass
class TrainingHooks:
    after_optimizer_step: Hook[int] = field(default_factory=Hook)
    """After every optimizer step (and its LR step), with the number of the step just taken: the weights changed."""
    after_load: Hook[int] = field(default_factory=Hook)
    """Once the starting state is in place (a resumed checkpoint, or the starting weights), with its step (0 for a
    fresh start)."""
    export: Hook[Any] = field(default_factory=Hook)
    """At the end of training, with the run's ``titanium.models.converter.ExportContext``: write artifacts."""
