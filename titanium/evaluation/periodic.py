"""Evaluations the loop runs every N steps without knowing what they are: each registered one
(titanium/config/components.py) is built from its own section and what it may use of the run.

``build(section, EvaluationContext) -> Periodic | None`` (None: its section leaves it off). The loop asks each
``Periodic`` whether it is ``due`` after every step (and runs those with ``at_start`` before the first) and logs
the numbers it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from titanium.batch import Batch
from titanium.config.sections import ChatSection, DataSection
from titanium.data.tokenizer import Tokenizer


class Periodic(Protocol):
    at_start: bool
    """Also run before the first step (a starting point to compare with)."""

    def due(self, step: int, last_step: int) -> bool: ...

    def run(self, step: int) -> dict[str, float]:
        """Run (on every rank together) and return the numbers to log, the same on every rank."""
        ...


@dataclass(frozen=True)
class EvaluationContext:
    """What an evaluation may use of the run, besides its own config section."""

    data: DataSection
    """The training data's section (its format and columns)."""
    chat: ChatSection
    tokenizer: Tokenizer
    model_name: str
    chat_format: str
    """The model family's default chat format ("" if none), as ``ObjectiveContext.chat_format``."""
    objective: Callable[[DataSection, int], Any]
    """``(data, seed offset) -> a new instance of the training objective`` reading ``data``."""
    loss_sums: Callable[[Batch], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """One microbatch of that objective -> (loss sum, unit count, the objective's metrics as ``[sum, count, ...]`` in
    its ``metric_names`` order) over all ranks: the loop's own forward, under the training plan."""
    policy: Any
    """The live policy (a ``titanium.model_handles.PolicyHandle``: ``lend()`` it for generation)."""
    dp_rank: int
    dp_world: int
    dp_group: dist.ProcessGroup | None
    device: torch.device
    processor: Any = None
    """The model's processor for rows beyond text (``ObjectiveContext.processor``: an image-text model's
    ``titanium.data.vision.ImageData``); None for a text model."""
