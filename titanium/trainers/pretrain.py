"""Pretraining: next-token cross-entropy over a stream of text windows."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from titanium.config.sections import DataSection
from titanium.data.loader import BatchLoader
from titanium.data.synthetic import SyntheticDataset
from titanium.data.text import TextDataset
from titanium.trainers.base import IGNORE_INDEX, Batch, LossResult, ModelOutput, Objective, ObjectiveContext


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in float32, skipping IGNORE_INDEX labels."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


class PretrainObjective(Objective):
    def __init__(self, ctx: ObjectiveContext, data: DataSection, section: None = None) -> None:
        if data.kind == "synthetic":
            dataset = SyntheticDataset(ctx.vocab_size, ctx.seq_len, ctx.seed, ctx.dp_rank, ctx.dp_world)
        else:
            dataset = TextDataset(data, ctx.tokenizer, ctx.seq_len, ctx.dp_rank, ctx.dp_world)
        self.dataset = dataset
        self.loader = BatchLoader(dataset, ctx.local_batch_size)

    def next_microbatch(self) -> Batch:
        return next(self.loader)

    def count(self, batch: Batch) -> torch.Tensor:
        return (batch["label"] != IGNORE_INDEX).sum()

    def model_inputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {"tokens": batch["input"]}

    def loss(self, output: ModelOutput, batch: Batch) -> LossResult:
        return LossResult(cross_entropy_sum(output.logits, batch["label"]))

    def log_metrics(self) -> dict[str, float]:
        bad = getattr(self.dataset, "bad_rows", 0)
        return {"data/skipped_rows": float(bad)} if bad else {}

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
