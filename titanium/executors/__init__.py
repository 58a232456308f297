"""Step executors: how a prepared step runs through the model (plain, or a pipeline schedule). The loop builds one
with ``build_executor`` and never branches on the layout."""

from __future__ import annotations

import torch

from titanium.config.sections import ParallelismSection
from titanium.executors.base import MetricVector, PreparedStep, StepExecutor, StepResult
from titanium.executors.pipeline import PipelineExecutor
from titanium.executors.plain import PlainExecutor
from titanium.model_builder import BuiltModel
from titanium.trainers.base import Objective


def build_executor(
    objective: Objective,
    built: BuiltModel,
    *,
    parallelism: ParallelismSection,
    local_batch_size: int,
    loss_parallel: bool,
    device: torch.device,
) -> StepExecutor:
    """The executor for ``built``'s layout; raises ConfigError for a layout ``objective`` refuses."""
    if built.pipeline is None:
        return PlainExecutor(objective, built, loss_parallel=loss_parallel, device=device)
    return PipelineExecutor(
        objective,
        built,
        parallelism=parallelism,
        local_batch_size=local_batch_size,
        loss_parallel=loss_parallel,
        device=device,
    )


__all__ = ["MetricVector", "PreparedStep", "StepExecutor", "StepResult", "build_executor"]
