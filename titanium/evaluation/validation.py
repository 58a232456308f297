"""Held-out loss and perplexity every N steps, under the training run's own parallel plan.

The validation data comes from a second instance of the training objective built on ``[validation] path`` (its
data pipeline, so packing, templates and bad-row handling are the same), and every validation starts that
instance from its first microbatch again, so the numbers are comparable over the run. The loss is the training
objective's, computed by the loop's own forward (FSDP, TP, CP, and under PP the training schedule run forward
only) and reduced like the training loss: the sum over every rank's loss units divided by their global count.
The objective's own metrics (a reward model's or DPO's pair accuracy, the kd divergence) are reduced the same way
over the held-out microbatches and logged beside the loss as ``validation/<metric>``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from collections.abc import Callable

import torch

from titanium.batch import Batch
from titanium.config.sections import ValidationSection
from titanium.evaluation.periodic import EvaluationContext
from titanium.objectives.base import Objective

logger = logging.getLogger("titanium")

LossSums = Callable[[Batch], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""One held-out microbatch -> (loss sum, unit count, the objective's metrics as ``[sum, count, ...]`` in its
``metric_names`` order), each over all ranks, as device tensors."""


class Validator:
    at_start = False

    def __init__(self, cfg: ValidationSection, objective: Objective, loss_sums: LossSums) -> None:
        self.cfg, self.objective, self.loss_sums = cfg, objective, loss_sums
        self._start = copy.deepcopy(objective.state_dict())

    def due(self, step: int, last_step: int) -> bool:
        return step % self.cfg.interval == 0 or step == last_step

    def run(self, step: int) -> dict[str, float]:
        """Loss over ``steps`` held-out microbatches (one host sync, at the end), the number of loss units it is
        the mean over (``validation/<unit>``: tokens, pairs, ...), for a token loss the perplexity, and the
        objective's metrics over the same microbatches (``validation/<metric>``)."""
        start = time.perf_counter()
        self.objective.load_state_dict(copy.deepcopy(self._start))
        totals = []
        for _ in range(self.cfg.steps):
            loss_sum, count, metrics = self.loss_sums(self.objective.next_microbatch())
            totals.append(torch.cat([torch.stack([loss_sum.float(), count.float()]), metrics.float()]))
        (loss_sum, count), *sums = torch.stack(totals).sum(0).view(-1, 2).tolist()
        loss, unit = loss_sum / max(count, 1.0), self.objective.loss_unit
        scalars = {"validation/loss": loss, f"validation/{unit}": count}
        if unit == "tokens":  # (a token cross-entropy: its exponential is the perplexity)
            scalars["validation/perplexity"] = math.exp(loss) if loss < 700 else math.inf
        metrics = {name: total / n for name, (total, n) in zip(self.objective.metric_names, sums) if n}
        scalars.update({f"validation/{name}": value for name, value in metrics.items()})
        shown = f", perplexity {scalars['validation/perplexity']:.2f}" if "validation/perplexity" in scalars else ""
        shown += "".join(f", {name} {value:.4f}" for name, value in metrics.items())
        seconds = time.perf_counter() - start
        logger.info(
            "validation step %d: loss %.4f%s over %d held-out %s (%.1fs)", step, loss, shown, count, unit, seconds
        )
        return scalars


def build_validator(cfg: ValidationSection, ctx: EvaluationContext) -> Validator | None:
    """Held-out loss (``interval`` > 0): the training objective's data pipeline on ``path``, its loss."""
    if cfg.interval == 0:
        return None
    data = dataclasses.replace(ctx.data, path=cfg.path)
    return Validator(cfg, ctx.objective(data, 1), ctx.loss_sums)  # (seed + 1: other synthetic windows)
