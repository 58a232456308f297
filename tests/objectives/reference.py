"""A test-only objective that uses every seam an objective like DPO needs (not shipped), given by import path.

Cross-entropy on the pretraining windows plus a penalty (its own config section, ``[reference] penalty``) that pulls
each token's log-prob towards a frozen reference's: the reference is a frozen model handle (built by the same
builder and plan), its log-probs are computed in the no-grad ``prepare`` phase and carried in a custom batch field,
and a metric comes back as (sum, count). Under pipeline parallelism its loss checks that it receives every field
of its microbatch's rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titanium.batch import Batch, per_row, per_token
from titanium.config.registry import SectionSpec
from titanium.config.sections import DataSection
from titanium.objectives.base import IGNORE_INDEX, LossResult, ModelOutput, Objective, ObjectiveContext, Prepared
from titanium.objectives.losses.cross_entropy import TokenFields
from titanium.objectives.pretrain import PretrainObjective


@dataclass
class ReferenceSection:
    """This objective's own config section, ``[reference]`` (it comes with the class: no registration)."""

    penalty: float = 10.0
    """Weight of the squared log-prob difference to the reference."""

    def problems(self, job: Any) -> Iterator[str]:
        """Checked at load, as the built-in sections' are, because the job's objective reads this section."""
        if self.penalty < 0:
            yield f"--reference.penalty must be >= 0, got {self.penalty}"


@dataclass
class ReferenceFields(TokenFields):
    """The pretraining labels plus two fields of this objective's own: a row id made with the batch and the
    reference's log-probs filled in ``prepare``."""

    row_id: torch.Tensor | None = per_row(default=None)
    ref_logp: torch.Tensor | None = per_token(default=None)


def token_logp(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-prob of each label (0 where the label is ignored), float32."""
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    logp = F.log_softmax(logits.float(), dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return logp * (labels != IGNORE_INDEX)


class ReferenceObjective(Objective):
    section = SectionSpec("reference", ReferenceSection)
    metric_names = ("test/ref_nll",)

    def __init__(self, ctx: ObjectiveContext, data: DataSection, section: ReferenceSection) -> None:
        assert ctx.models is not None and isinstance(section, ReferenceSection), section
        self.penalty = section.penalty
        self.inner = PretrainObjective(ctx, data)
        self.reference = ctx.models.frozen()  # (the policy as it started; with LoRA: adapters off, no copy)

    def next_microbatch(self) -> Batch[ReferenceFields]:
        batch = self.inner.next_microbatch()
        rows = torch.arange(batch.rows)
        return Batch(batch.tokens, ReferenceFields(batch.fields.labels, row_id=rows), batch.positions)

    def prepare(self, microbatches: list[Batch[ReferenceFields]]) -> Prepared:
        for mb in microbatches:
            logits = self.reference(mb)
            if logits is not None:  # (pipeline ranks without the last stage get None)
                mb.fields.ref_logp = token_logp(logits, mb.fields.labels)
        return Prepared(microbatches)

    def loss(self, output: ModelOutput, batch: Batch[ReferenceFields]) -> LossResult:
        fields = batch.fields
        if fields.row_id is None or fields.ref_logp is None:
            raise AssertionError("the loss did not get the whole microbatch: a field is missing")
        shapes = {"labels": fields.labels.shape, "row_id": fields.row_id.shape, "ref_logp": fields.ref_logp.shape}
        if any(shape[0] != batch.rows for shape in shapes.values()):
            raise AssertionError(shapes)
        mask = fields.labels != IGNORE_INDEX
        logp = token_logp(output.logits, fields.labels)
        loss = -logp.sum() + self.penalty * ((logp - fields.ref_logp) ** 2 * mask).sum()
        return LossResult(loss, {"test/ref_nll": (-fields.ref_logp.sum(), mask.sum())})

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
