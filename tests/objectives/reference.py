"""A test-only objective that uses every seam an objective like DPO needs (not shipped).

Cross-entropy on the pretraining windows plus a penalty that pulls each token's log-prob towards a frozen
reference's: the reference is asked from the loop (built by the same builder and plan), its log-probs are
computed in the no-grad ``prepare`` phase and carried as an extra microbatch key, and two metrics come back
as (sum, count). Under pipeline parallelism its loss checks that it receives every key of its microbatch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titanium.config.sections import DataSection
from titanium.trainers.base import IGNORE_INDEX, Batch, LossResult, ModelOutput, Objective, ObjectiveContext
from titanium.trainers.pretrain import PretrainObjective

PENALTY = 10.0
KEYS = {"input", "label", "row_id", "ref_logp"}


def token_logp(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-prob of each label (0 where the label is ignored), float32."""
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    logp = F.log_softmax(logits.float(), dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return logp * (labels != IGNORE_INDEX)


class ReferenceObjective(Objective):
    metric_names = ("test/ref_nll",)

    def __init__(self, ctx: ObjectiveContext, data: DataSection, section: None = None) -> None:
        assert ctx.frozen_model is not None
        self.inner = PretrainObjective(ctx, data)
        self.reference = ctx.frozen_model()

    def next_microbatch(self) -> Batch:
        batch = self.inner.next_microbatch()
        batch["row_id"] = torch.arange(batch["input"].shape[0])
        return batch

    def prepare(self, microbatches: list[Batch]) -> list[Batch]:
        for mb in microbatches:
            logits = self.reference(mb)
            if logits is not None:  # (pipeline ranks without the last stage get None)
                mb["ref_logp"] = token_logp(logits, mb["label"])
        return microbatches

    def count(self, batch: Batch) -> torch.Tensor:
        return self.inner.count(batch)

    def model_inputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        return self.inner.model_inputs(batch)

    def loss(self, output: ModelOutput, batch: Batch) -> LossResult:
        missing = KEYS - set(batch)
        if missing:
            raise AssertionError(f"the loss did not get the whole microbatch: missing {sorted(missing)}")
        rows = batch["input"].shape[0]
        if any(batch[k].shape[0] != rows for k in KEYS):
            raise AssertionError({k: tuple(batch[k].shape) for k in KEYS})
        mask = batch["label"] != IGNORE_INDEX
        logp = token_logp(output.logits, batch["label"])
        loss = -logp.sum() + PENALTY * ((logp - batch["ref_logp"]) ** 2 * mask).sum()
        return LossResult(loss, {"test/ref_nll": (-batch["ref_logp"].sum(), mask.sum())})

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
