"""Pretraining: next-token cross-entropy over a stream of text windows."""

from __future__ import annotations

from typing import Any

from titanium.batch import Batch
from titanium.config.sections import DataSection
from titanium.data.loader import BatchLoader
from titanium.data.synthetic import SyntheticDataset
from titanium.data.text import TextDataset
from titanium.objectives.base import LossResult, ModelOutput, Objective, ObjectiveContext, Prepared
from titanium.objectives.losses.cross_entropy import TokenCrossEntropy, token_batch


class PretrainObjective(Objective):
    def __init__(self, ctx: ObjectiveContext, data: DataSection, section: None = None) -> None:
        self.cross_entropy = TokenCrossEntropy(ctx.loss_chunk_size)
        self.loss_input = self.cross_entropy.loss_input
        if data.kind == "synthetic":
            dataset = SyntheticDataset(ctx.vocab_size, ctx.seq_len, ctx.seed, ctx.dp_rank, ctx.dp_world)
        else:
            dataset = TextDataset(data, ctx.tokenizer, ctx.seq_len, ctx.dp_rank, ctx.dp_world)
        self.dataset = dataset
        pin = ctx.device.type == "cuda"
        self.loader = BatchLoader(dataset, ctx.local_batch_size, data.prefetch_batches, pin_memory=pin)

    def next_microbatch(self) -> Batch:
        return token_batch(next(self.loader))

    def prepare(self, microbatches: list[Batch]) -> Prepared:
        return Prepared(self.cross_entropy.prepare(microbatches))

    def loss(self, output: ModelOutput, batch: Batch) -> LossResult:
        return LossResult(self.cross_entropy(output, batch))

    def log_metrics(self) -> dict[str, float]:
        bad = getattr(self.dataset, "bad_rows", 0)
        return {"data/skipped_rows": float(bad)} if bad else {}

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
