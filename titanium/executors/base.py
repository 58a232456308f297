"""What a step executor is: it runs a prepared step's forward and backward through the model, however the model
is laid out, and returns a typed result. The loop never knows which executor runs.

The loss rule lives here: each microbatch's loss sum is divided by the step's global unit count (all-reduced by
the loop once, before the forward), so gradient accumulation, any data-parallel degree and pipeline microbatches
give the exact mean gradient of the whole step.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel as sharded_cross_entropy

from titanium.batch import Batch
from titanium.config.sections import ParallelismSection
from titanium.hooks import Hook
from titanium.model_builder import BuiltModel
from titanium.objectives.base import LossResult, Metrics, ModelOutput, Objective
from titanium.parallel.grad_norm import clip_grad_norm


@dataclass
class PreparedStep:
    """A step's microbatches ready for the forward: placed (context parallelism: this rank's part of each
    sequence), on the device, after the objective's ``prepare``."""

    batches: list[Batch]
    units: torch.Tensor
    """The loss units of the whole step over every rank that adds up (data and context parallel ones)."""
    metrics: Metrics = field(default_factory=dict)
    """What ``prepare`` measured, added once per step."""
    tokens: int = 0
    """Tokens the model processes for the step on this data-parallel rank (whole sequences), for throughput."""


@dataclass
class StepResult:
    """What a step's forward (and backward) gave, as device tensors (no host sync)."""

    loss_sum: torch.Tensor
    """This rank's sum of the per-unit losses (under tensor parallelism each tp rank holds a copy; under pipeline
    parallelism only the last stage's ranks hold one)."""
    units: torch.Tensor
    """The step's global unit count (the loss is ``loss_sum`` summed over ranks divided by it)."""
    metrics: torch.Tensor
    """The objective's metrics as ``[sum, count, sum, count, ...]`` in ``metric_names`` order, this rank's part."""


@dataclass(frozen=True)
class ExecutorOptions:
    """What an executor needs of the job besides the objective and the model."""

    parallelism: ParallelismSection
    local_batch_size: int
    loss_parallel: bool
    """The logits are vocabulary-sharded (tensor parallelism with loss parallel)."""
    device: torch.device
    loss_terms: Hook[Batch, torch.Tensor | None] = field(default_factory=Hook)
    """Terms features add to each training microbatch's loss (``TrainingHooks.loss_term``)."""


class MetricVector:
    """An objective's (sum, count) metrics packed into one tensor in a fixed order, so every rank reduces the same
    list in one all-reduce."""

    def __init__(self, names: tuple[str, ...], device: torch.device) -> None:
        self.names, self.device = names, device

    def zeros(self) -> torch.Tensor:
        return torch.zeros(2 * len(self.names), device=self.device)

    def of(self, metrics: Metrics) -> torch.Tensor:
        vector = self.zeros()
        for i, name in enumerate(self.names):
            if name in metrics:
                total, count = metrics[name]
                vector[2 * i] = total.detach().float()
                vector[2 * i + 1] = count.detach().float()
        return vector


class StepExecutor(ABC):
    """Runs steps of ``objective`` through ``built``."""

    def __init__(self, objective: Objective, built: BuiltModel, options: ExecutorOptions) -> None:
        self.objective, self.built, self.device = objective, built, options.device
        self.metrics = MetricVector(tuple(objective.metric_names), options.device)
        # With loss parallel the logits are vocab-sharded DTensors; the context makes cross-entropy
        # (forward and backward) work on the shards.
        self.sharded_loss: Callable[[], contextlib.AbstractContextManager] = (
            sharded_cross_entropy if options.loss_parallel else contextlib.nullcontext
        )

    @abstractmethod
    def run(self, step: PreparedStep, backward: bool = True) -> StepResult:
        """Forward (and, with ``backward``, backward) of every microbatch of ``step``: gradients of
        ``sum(loss) / step.units`` accumulate in the parameters. ``backward=False``: the losses only."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm (clipped to ``max_norm`` unless it is 0), as a device tensor."""
        params = [p for p in self.built.model.parameters() if p.grad is not None]
        return clip_grad_norm(params, max_norm, self.built.pp_group, device=self.device)

    def metric_groups(self, loss_group: dist.ProcessGroup) -> list[dist.ProcessGroup]:
        """The groups over which the metric sums add up (``loss_group``: the data and context parallel ranks)."""
        return [loss_group]

    def loss(self, output: ModelOutput, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The objective's loss sum (a plain tensor) and its metric vector."""
        result: LossResult = self.objective.loss(output, batch)
        loss_sum = result.loss_sum
        return (loss_sum.full_tensor() if isinstance(loss_sum, DTensor) else loss_sum), self.metrics.of(result.metrics)
