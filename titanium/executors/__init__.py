"""Step executors: how a prepared step runs through the model (plain, or a pipeline schedule). The loop builds one
with ``build_executor`` and never branches on the layout."""

from __future__ import annotations

from titanium.executors.base import ExecutorOptions, MetricVector, PreparedStep, StepExecutor, StepResult
from titanium.executors.pipeline import PipelineExecutor
from titanium.executors.plain import PlainExecutor
from titanium.model_builder import BuiltModel
from titanium.objectives.base import Objective


def build_executor(objective: Objective, built: BuiltModel, options: ExecutorOptions) -> StepExecutor:
    """The executor for ``built``'s layout; raises ConfigError for a layout ``objective`` refuses."""
    executor = PlainExecutor if built.pipeline is None else PipelineExecutor
    return executor(objective, built, options)


__all__ = ["ExecutorOptions", "MetricVector", "PreparedStep", "StepExecutor", "StepResult", "build_executor"]
