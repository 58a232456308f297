"""Batches from a resumable sample stream, made in the training process, inline or in a background thread.

With ``prefetch`` > 0 a thread stacks the next batches ahead (titanium.data.prefetch) and records, with
each batch, the dataset's state right after it. The loader's state is the one recorded with the last batch
handed out, never the dataset's live position (which is ahead by the prefetched batches), so a resumed run
starts exactly after the last batch the training loop took.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch

from titanium.data.prefetch import Prefetcher

Batch = dict[str, torch.Tensor]


class ResumableDataset(Protocol):
    def __iter__(self) -> Iterator[Any]: ...
    def state_dict(self) -> dict[str, Any]:
        """A snapshot: later iteration must not change the returned objects."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class BatchLoader:
    """Stacks `batch_size` samples into one batch with ``collate_fn`` (by default ``collate``: rows of one width
    stacked; or samples padded together, titanium.data.packing.padded_rows); checkpointable through the dataset's
    state.

    ``prefetch``: batches made ahead in a background thread (0: inline). ``pin_memory``: put batches in
    page-locked memory so the copy to the GPU (``.to(device, non_blocking=True)``) overlaps compute; only
    with CUDA.
    """

    def __init__(
        self,
        dataset: ResumableDataset,
        batch_size: int,
        prefetch: int = 0,
        pin_memory: bool = False,
        collate_fn: Callable[[list[Any]], Batch] | None = None,
    ):
        self.dataset, self.batch_size, self.prefetch, self.pin_memory = dataset, batch_size, prefetch, pin_memory
        self.collate_fn = collate_fn or collate
        self._samples: Iterator[Batch] | None = None
        self._prefetcher: Prefetcher[tuple[Batch, dict[str, Any]]] | None = None
        self._handed_out: dict[str, Any] | None = None  # the dataset's state after the last batch handed out

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> Batch:
        if not self.prefetch:
            if self._samples is None:
                self._samples = iter(self.dataset)
            return self._batch(self._samples)
        if self._prefetcher is None:
            self._handed_out = self.dataset.state_dict()
            self._prefetcher = Prefetcher(self._batches_and_states, self.prefetch)
        batch, self._handed_out = self._prefetcher.get()
        return batch

    def _batch(self, samples: Iterator[Batch]) -> Batch:
        batch = self.collate_fn([next(samples) for _ in range(self.batch_size)])
        return {k: v.pin_memory() for k, v in batch.items()} if self.pin_memory else batch

    def _batches_and_states(self) -> Iterator[tuple[Batch, dict[str, Any]]]:
        """(batch, dataset state right after it): runs in the prefetch thread."""
        samples = iter(self.dataset)
        while True:
            try:
                batch = self._batch(samples)
            except StopIteration:
                return
            yield batch, self.dataset.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return self._handed_out if self._prefetcher is not None else self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.close()
        self.dataset.load_state_dict(state)
        self._samples = None  # restart the generator from the restored position

    def close(self) -> None:
        """Stop the prefetch thread; the dataset goes back to the position after the last batch handed out."""
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
            assert self._handed_out is not None
            self.dataset.load_state_dict(self._handed_out)


def collate(samples: Iterable[Batch]) -> Batch:
    samples = list(samples)
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
