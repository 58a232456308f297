"""Held-out loss and perplexity every N steps, under the training run's own parallel plan.

The validation data comes from a second instance of the training objective built on ``[validation] path`` (its
data pipeline, so packing, templates and bad-row handling are the same), and every validation starts that
instance from its first microbatch again, so the numbers are comparable over the run. The loss is the training
objective's, computed by the loop's own forward (FSDP, TP, CP, and under PP the training schedule run forward
only) and reduced like the training loss: the sum over every rank's loss units divided by their global count.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable

import torch

from titanium.config.sections import ValidationSection
from titanium.trainers.base import Batch, Objective

logger = logging.getLogger("titanium")

LossSums = Callable[[Batch], tuple[torch.Tensor, torch.Tensor]]
"""One held-out microbatch -> (loss sum, unit count), each over all ranks, as device tensors."""


class Validator:
    def __init__(self, cfg: ValidationSection, objective: Objective, loss_sums: LossSums) -> None:
        self.cfg, self.objective, self.loss_sums = cfg, objective, loss_sums
        self._start = copy.deepcopy(objective.state_dict())

    def due(self, step: int, last_step: int) -> bool:
        return step % self.cfg.interval == 0 or step == last_step

    def run(self, step: int) -> dict[str, float]:
        """Loss and perplexity over ``steps`` held-out microbatches (one host sync, at the end)."""
        start = time.perf_counter()
        self.objective.load_state_dict(copy.deepcopy(self._start))
        totals = []
        for _ in range(self.cfg.steps):
            loss_sum, count = self.loss_sums(self.objective.next_microbatch())
            totals.append(torch.stack([loss_sum.float(), count.float()]))
        loss_sum, count = torch.stack(totals).sum(0).tolist()
        loss = loss_sum / max(count, 1.0)
        perplexity = math.exp(loss) if loss < 700 else math.inf
        logger.info(
            "validation step %d: loss %.4f, perplexity %.2f over %d scored held-out tokens (%.1fs)",
            step,
            loss,
            perplexity,
            count,
            time.perf_counter() - start,
        )
        return {"validation/loss": loss, "validation/perplexity": perplexity, "validation/tokens": count}
