"""The plain executor: the whole model on every rank of its data/tensor/context-parallel layout, one forward and
backward per microbatch."""

from __future__ import annotations

import torch

from titanium.executors.base import ExecutorOptions, PreparedStep, StepExecutor, StepResult
from titanium.model_builder import BuiltModel
from titanium.objectives.base import ModelOutput, Objective


class PlainExecutor(StepExecutor):
    def __init__(self, objective: Objective, built: BuiltModel, options: ExecutorOptions) -> None:
        objective.check_layout(None)
        super().__init__(objective, built, options)
        self.loss_terms = options.loss_terms

    def run(self, step: PreparedStep, backward: bool = True) -> StepResult:
        divisor = step.units.clamp(min=1).float()
        model, hidden = self.built.model, self.objective.loss_input == "hidden"
        metrics = self.metrics.of(step.metrics)
        loss_total = torch.zeros((), device=metrics.device)
        for batch in step.batches:
            with self.sharded_loss():
                with self.built.autocast():
                    inputs = batch.model_inputs()
                    if hidden:  # the objective projects chunk by chunk (chunked cross-entropy)
                        output = ModelOutput(hidden=model(**inputs, project=False), projection=model.output)
                    else:
                        output = ModelOutput(logits=model(**inputs))
                    loss_sum, batch_metrics = self.loss(output, batch)
                del output  # the logits: the backward keeps what it needs of them
                if backward:  # outside autocast, whose cache of low-precision weight copies is freed on exit
                    terms = [term for term in self.loss_terms(batch) if term is not None]
                    (loss_sum / divisor + sum(terms)).backward()
            metrics += batch_metrics
            loss_total += loss_sum.detach()
            del loss_sum
        return StepResult(loss_total, step.units, metrics)
