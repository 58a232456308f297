"""The objective interface: what to optimize. The loop in titanium/trainer.py owns everything else.

An objective owns its data pipeline (and, later, extra models such as a frozen reference policy).
For each microbatch it says how many loss units it holds (valid tokens for cross-entropy) and the
*sum* of the per-unit losses. The loop divides by the global unit count of the whole step, all-reduced
once before the forward, so gradient accumulation, any data-parallel degree and padding all give the
exact mean gradient of the full batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from titanium.data.tokenizer import Tokenizer

IGNORE_INDEX = -100
"""Label value that carries no loss (padding, prompt tokens)."""

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ObjectiveContext:
    """What the loop hands an objective at construction: no config beyond the sections it needs."""

    tokenizer: Tokenizer
    model_name: str
    """Model family (registry key), e.g. for choosing its chat format."""
    vocab_size: int
    seq_len: int
    local_batch_size: int
    dp_rank: int
    dp_world: int
    seed: int


class Objective(ABC):
    @abstractmethod
    def next_microbatch(self) -> Batch:
        """The next microbatch for this data-parallel rank, as CPU tensors."""

    @abstractmethod
    def count(self, batch: Batch) -> torch.Tensor:
        """Number of loss units in `batch` (an integer tensor); known before the forward pass."""

    @abstractmethod
    def model_inputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Keyword arguments for the model's forward."""

    @abstractmethod
    def loss_sum(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Sum (not mean) of the per-unit losses of `batch`."""

    def tokens(self, batch: Batch) -> int:
        """Tokens the model processes for `batch` (for throughput), known without a device sync."""
        return batch["input"].numel()

    def log_metrics(self) -> dict[str, float]:
        """Objective-specific numbers for the log line (e.g. skipped rows)."""
        return {}

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Data position and any other per-rank state to checkpoint."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
