"""``[lm_eval]``: lm-evaluation-harness tasks run on the live policy every N steps (titanium/evaluation/lm_eval.py),
and the checks of its values that need no process group."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

INSTALL_HINT = "pip install -e '.[eval]' (lm-eval 0.4.13)"
"""How to get lm-evaluation-harness, the optional dependency of [lm_eval] and titanium.tools.eval."""


@dataclass
class LMEvalSection:
    interval: int = 0
    """Every N steps (and after the last), run the lm-evaluation-harness tasks below on the live policy, under the
    training plan, and log each task's metrics as lm_eval/<task>/<metric> beside the loss (TensorBoard, W&B). Needs
    the optional dependency (pip install -e '.[eval]'). 0 turns it off."""
    tasks: list[str] = field(default_factory=list)
    """lm-eval task (or group) names, e.g. ["arithmetic_mc", "arithmetic_gen"] with include_path
    "assets/tasks/arithmetic/lm_eval"; tasks that download their data need the Hub."""
    include_path: str = ""
    """A folder of extra lm-eval task YAMLs (lm_eval --include_path); "" for lm-eval's own tasks only."""
    limit: int = 0
    """Evaluate the first N documents of each task (lm_eval --limit); 0 for all of them."""
    num_fewshot: int = -1
    """Few-shot examples per prompt (lm_eval --num_fewshot); -1 keeps each task's own setting."""
    batch_size: int = 8
    """Requests per forward (log-likelihoods) or prompts generated together, on each data-parallel rank."""
    apply_chat_template: bool = False
    """Render prompts with the run's chat template ([chat] chat_template), few-shot examples as turns, as
    lm_eval --apply_chat_template does; for instruct models."""
    max_gen_toks: int = 256
    """Most tokens generated per answer where a task's generation_kwargs do not say (lm-eval's default)."""

    def problems(self, job: Any) -> Iterator[str]:
        """This section's checks (titanium/config/validate.py runs every registered section's ``problems``)."""
        return check_lm_eval(self)


def check_lm_eval(cfg: LMEvalSection) -> Iterator[str]:
    """What is wrong with ``[lm_eval]``, one message per problem (nothing when it is off)."""
    if cfg.interval < 0:
        yield f"--lm_eval.interval must be >= 0 (0 turns it off), got {cfg.interval}"
    if cfg.interval <= 0:
        return
    if not cfg.tasks:
        yield "--lm_eval.interval is set but --lm_eval.tasks is empty; name the lm-eval tasks to run"
    if cfg.limit < 0:
        yield f"--lm_eval.limit must be >= 0 (0: every document), got {cfg.limit}"
    if cfg.num_fewshot < -1:
        yield f"--lm_eval.num_fewshot must be >= 0 (or -1: each task's own), got {cfg.num_fewshot}"
    if cfg.batch_size < 1:
        yield f"--lm_eval.batch_size must be >= 1, got {cfg.batch_size}"
    if cfg.max_gen_toks < 1:
        yield f"--lm_eval.max_gen_toks must be >= 1, got {cfg.max_gen_toks}"
    if importlib.util.find_spec("lm_eval") is None:
        yield f"--lm_eval.interval needs lm-evaluation-harness, which is not installed: {INSTALL_HINT}"
