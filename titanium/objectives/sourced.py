"""What GRPO, PPO and online DPO share as objectives drawing their rows from the rollout source
(``titanium.rl.source.RolloutSource``): the source checked before any process starts, empty batches out (the rows are
made in ``prepare``), and its logs, tables, checkpoint state and fault-tolerant catch-up."""

from __future__ import annotations

from typing import Any

from titanium.batch import Batch, empty_batch
from titanium.metrics.table import Table
from titanium.objectives.base import JobFacts, Objective
from titanium.rl.source import RolloutSource, check_source


class SourcedObjective(Objective):
    """An objective whose ``__init__`` sets ``self.source``; what it does beyond the source is its own."""

    source: RolloutSource

    @classmethod
    def check_config(cls, section: Any, job: JobFacts, **more: Any) -> None:
        """Beyond the models it builds from folders: its rollout source (rewards, environment, engine)."""
        super().check_config(section, job, **more)
        check_source(job, **more)

    def close(self) -> None:
        self.source.close()

    def next_microbatch(self) -> Batch:
        return empty_batch()

    def log_metrics(self) -> dict[str, float]:
        return self.source.log_metrics()

    def tables(self, step: int) -> dict[str, Table]:
        """Every ``log_completions`` steps: the first responses of the batch trained on, with what the objective kept
        of them (rewards, scores, advantages)."""
        return self.source.tables(step)

    def state_dict(self) -> dict[str, Any]:
        return self.source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state)

    def skip_ahead(self, steps: int, step: int, microbatches_per_step: int) -> None:
        self.source.skip_ahead(step, microbatches_per_step)
