"""``[lm_eval]`` as the loop runs it: lm-evaluation-harness tasks on the live policy before the first step, every
``interval`` steps and after the last, logged as ``lm_eval/<task>/<metric>`` beside the loss.

The policy runs as it trains (sharded by FSDP, under the training forward's precision), lent in eval mode; each
data-parallel rank evaluates its share of the requests and every rank runs the same forwards
(titanium/evaluation/lm.py). lm-eval aggregates the scores on data-parallel rank 0, which hands them to the others so
every rank logs the same numbers. Tensor, pipeline and context parallelism are not supported here (each would need
the requests cut to its layout); the eval tool runs such a run's checkpoints under FSDP.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from titanium.config.errors import ConfigError
from titanium.config.lm_eval_section import LMEvalSection
from titanium.data.chat import build_chat_template
from titanium.evaluation.harness import TaskRun, metric_scalars, run_tasks, task_manager
from titanium.evaluation.periodic import EvaluationContext

logger = logging.getLogger("titanium")


class LMEvalEvaluation:
    at_start = True

    def __init__(self, cfg: LMEvalSection, ctx: EvaluationContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        logging.getLogger("lm_eval").setLevel(logging.WARNING)  # (its progress lines would crowd the training log)
        self.manager = task_manager(cfg.tasks, cfg.include_path or None, flag="--lm_eval.tasks")
        self.template = None
        if cfg.apply_chat_template:
            self.template = build_chat_template(ctx.chat.chat_template, ctx.tokenizer, ctx.chat_format)
        self.group = ctx.dp_group if ctx.dp_world > 1 else None
        self.run_spec = TaskRun(
            tasks=cfg.tasks,
            limit=cfg.limit or None,
            num_fewshot=cfg.num_fewshot if cfg.num_fewshot >= 0 else None,
            apply_chat_template=cfg.apply_chat_template,
            bootstrap_iters=0,  # (standard errors by resampling take longer than a small evaluation)
        )

    def due(self, step: int, last_step: int) -> bool:
        return step % self.cfg.interval == 0 or step == last_step

    def run(self, step: int) -> dict[str, float]:
        from titanium.evaluation.lm import TitaniumLM

        start = time.perf_counter()
        with _random_states_kept(), self.ctx.policy.lend() as model:
            lm = TitaniumLM(
                model,
                self.ctx.tokenizer,
                max_length=model.args.max_seq_len,
                batch_size=self.cfg.batch_size,
                max_gen_toks=self.cfg.max_gen_toks,
                template=self.template,
                device=self.ctx.device,
                group=self.group,
            )
            results = run_tasks(lm, self.run_spec, self.manager)
        scalars = [metric_scalars(results) if results is not None else None]
        if self.group is not None:
            dist.broadcast_object_list(scalars, src=dist.get_global_rank(self.group, 0), group=self.group)
        numbers: dict[str, float] = scalars[0] or {}
        shown = ", ".join(f"{name.removeprefix('lm_eval/')} {value:.4f}" for name, value in numbers.items())
        logger.info("lm_eval step %d: %s (%.1fs)", step, shown, time.perf_counter() - start)
        return numbers


@contextlib.contextmanager
def _random_states_kept() -> Iterator[None]:
    """lm-eval seeds Python's, NumPy's and torch's global generators (for its few-shot draws): give the run back the
    states it had, so an evaluation changes nothing that training draws afterwards."""
    import numpy as np

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def build_lm_eval(cfg: LMEvalSection, ctx: EvaluationContext) -> LMEvalEvaluation | None:
    """lm-eval tasks on the live policy (``interval`` > 0), on every data-parallel rank."""
    if cfg.interval == 0:
        return None
    policy: Any = ctx.policy
    if policy.tp_group is not None or policy.pp_group is not None:
        raise ConfigError(
            "--lm_eval.interval: lm-eval tasks run under data parallelism (FSDP) only, not with tensor or pipeline "
            "parallelism; evaluate the run's checkpoints with python -m titanium.tools.eval instead"
        )
    return LMEvalEvaluation(cfg, ctx)
