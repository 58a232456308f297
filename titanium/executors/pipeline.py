"""The pipeline executor: a pipeline schedule runs forward and backward of all pipeline microbatches of each of
the objective's microbatches; the last stage computes the loss.

The schedule calls the loss with the last stage's output and the indices of the rows the pipeline microbatch
holds; the objective then sees those rows of its microbatch with every field it carries (never a rebuilt
batch). The microbatch being run and its losses' metrics are this executor's own state for the length of one
``run``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from titanium.batch import Batch
from titanium.executors.base import ExecutorOptions, PreparedStep, StepExecutor, StepResult
from titanium.model_builder import BuiltModel
from titanium.objectives.base import ModelOutput, Objective
from titanium.parallel.pipeline import Pipeline


class PipelineExecutor(StepExecutor):
    def __init__(self, objective: Objective, built: BuiltModel, options: ExecutorOptions) -> None:
        objective.check_layout(options.parallelism.pipeline_parallel_microbatch_size)
        super().__init__(objective, built, options)
        assert built.pipeline is not None
        assert not options.loss_terms, "a loss term needs the whole model's forward; its owner refuses pipelines"
        self.pipeline: Pipeline = built.pipeline
        self.pipeline.build_schedule(
            options.parallelism, options.local_batch_size, options.device, loss_fn=self._pipeline_loss
        )
        self._batch: Batch | None = None
        self._divisor = torch.ones(())
        self._metrics: dict[int, torch.Tensor] = {}

    def run(self, step: PreparedStep, backward: bool = True) -> StepResult:
        self._divisor = step.units.clamp(min=1).float()
        metrics = self.metrics.zeros()
        if self.pipeline.has_last_stage:  # (the ranks that compute the loss; the others' metrics stay 0)
            metrics += self.metrics.of(step.metrics)
        loss_total = torch.zeros((), device=metrics.device)
        for batch in step.batches:
            self._batch, self._metrics = batch, {}
            try:
                with self.sharded_loss(), self.built.autocast():
                    losses = self.pipeline.step(batch.model_inputs(), backward=backward)
            finally:
                self._batch = None
            if losses:
                loss_total += torch.stack([loss.detach() for loss in losses]).sum() * self._divisor
            for loss in losses:  # (only the losses the schedule kept: it may also call the loss to infer shapes)
                metrics += self._metrics[id(loss)]
        return StepResult(loss_total, step.units, metrics)

    def _pipeline_loss(self, output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one pipeline microbatch (``rows`` of the objective's microbatch)."""
        assert self._batch is not None, "the schedule runs the loss inside run()"
        loss_sum, metrics = self.loss(ModelOutput(logits=output), self._batch.select_rows(rows))
        loss = loss_sum / self._divisor
        self._metrics[id(loss)] = metrics
        return loss

    def metric_groups(self, loss_group: dist.ProcessGroup) -> list[dist.ProcessGroup]:
        return [loss_group, self.pipeline.pp_group]  # (only the last stage computed them)
