"""Batches from a resumable sample stream, read in the training process (no worker processes).

Reading in-process keeps the saved position exact: the dataset's state always describes the
samples already handed out, never ones prefetched by a worker and not yet used.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch


class ResumableDataset(Protocol):
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class BatchLoader:
    """Stacks `batch_size` samples into one batch; checkpointable through the dataset's state."""

    def __init__(self, dataset: ResumableDataset, batch_size: int) -> None:
        self.dataset, self.batch_size = dataset, batch_size
        self._samples: Iterator[dict[str, torch.Tensor]] | None = None

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._samples is None:
            self._samples = iter(self.dataset)
        samples = [next(self._samples) for _ in range(self.batch_size)]
        return collate(samples)

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)
        self._samples = None  # restart the generator from the restored position


def collate(samples: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    samples = list(samples)
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
