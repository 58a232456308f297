"""Rollouts between generation and training: a batch served for ppo_epochs x minibatches optimizer steps, and
the queue of batches started ahead of use (their generation maybe still running on the generation thread), which
bounds how stale the policy that made them may be.

The policy version is the number of optimizer steps taken. A batch made at version v and first trained on
at version u has a lag of u - v steps at its first use; every later step on the same batch (further
minibatches, further epochs) adds one more, as in PPO.
"""

from __future__ import annotations

import io
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

Batch = dict[str, torch.Tensor]


@dataclass
class RolloutBatch:
    """One rank's rollouts ready to train on, served as ``minibatches`` consecutive parts per epoch, one part
    per optimizer step, ``epochs`` times over."""

    rows: Batch
    """Every tensor has the batch's responses as rows (groups contiguous), on the device."""
    version: int
    """Optimizer steps the policy that generated it had taken."""
    minibatches: int
    epochs: int
    resume_point: dict[str, Any] = field(default_factory=dict)
    """The prompt position before it: where a group that heals under fault tolerance starts over."""
    generated_tokens: int = 0
    generation_seconds: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    """What was measured while making it (the engine/trainer mismatch), as (sum, count) pairs, logged once."""
    served: int = 0
    """Optimizer steps served so far."""

    @property
    def responses(self) -> int:
        return len(next(iter(self.rows.values())))

    @property
    def steps_left(self) -> int:
        return self.minibatches * self.epochs - self.served

    def to_bytes(self) -> bytes:
        """Its rows (copied to the CPU), how far it was served and its resume point, for a checkpoint that resumes
        mid-batch."""
        buffer = io.BytesIO()
        rows = {k: v.cpu() for k, v in self.rows.items()}
        serving = [self.version, self.minibatches, self.epochs, self.served]
        torch.save({"rows": rows, "serving": serving, "resume_point": self.resume_point}, buffer)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, device: torch.device) -> RolloutBatch:
        """The batch ``to_bytes`` saved, its rows on ``device``, served as far as it was."""
        state = torch.load(io.BytesIO(data), weights_only=True)
        version, minibatches, epochs, served = state["serving"]
        rows = {k: v.to(device) for k, v in state["rows"].items()}
        return cls(rows, version, minibatches, epochs, state.get("resume_point", {}), served=served)

    def next_step(self, microbatches: int) -> list[Batch]:
        """The next step's part of the rows, as ``microbatches`` equal microbatches (views, no copy)."""
        assert self.steps_left > 0, "rollout batch used up"
        rows = len(next(iter(self.rows.values())))
        per_step = rows // self.minibatches
        size = per_step // microbatches
        assert size * microbatches * self.minibatches == rows, (rows, self.minibatches, microbatches)
        start = (self.served % self.minibatches) * per_step
        self.served += 1
        return [
            {k: v[start + i * size : start + (i + 1) * size] for k, v in self.rows.items()} for i in range(microbatches)
        ]


@dataclass
class PendingBatch:
    """A rollout batch whose generation has started (on the generation thread, or done already); its rows are
    made at its first use (``titanium.rl.source.RolloutSource``)."""

    generation: Future
    """What the objective's generation returns (its sampled batch: prompts, scored rollouts, the version that
    made them) and the seconds it took."""
    version: int
    """The engine's weights' version when generation started (no sync happens while it runs)."""
    responses: int
    resume_point: dict[str, Any] = field(default_factory=dict)
    """As ``RolloutBatch.resume_point``."""


class Queued(Protocol):
    version: int

    @property
    def responses(self) -> int: ...


class RolloutQueue:
    """Rollout batches started ahead of their first use, oldest first. ``pop_fresh(version)`` hands out the
    oldest batch whose lag would be at most ``max_lag``; older ones are dropped and counted in ``dropped``
    (rollouts, i.e. responses)."""

    def __init__(self, max_lag: int) -> None:
        self.max_lag = max_lag
        self.batches: deque[Any] = deque()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self.batches)

    def put(self, batch: Queued) -> None:
        self.batches.append(batch)

    def pop_fresh(self, version: int) -> Any:
        """The oldest queued batch (a ``RolloutBatch`` or ``PendingBatch``) fresh enough for ``version``, or None."""
        while self.batches:
            batch = self.batches.popleft()
            if version - batch.version <= self.max_lag:
                return batch
            self.dropped += batch.responses
        return None

    def clear(self) -> None:
        self.batches.clear()
