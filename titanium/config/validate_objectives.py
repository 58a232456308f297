"""Config checks of the reward and kd objectives: bad ranges and the layouts they cannot run under, named before
any process group exists (exit code 2)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def _unsupported_layouts(cfg: Any, objective: str, why: dict[str, str]) -> Iterator[str]:
    """One message per parallel degree > 1 that ``objective`` refuses (``why``: degree name -> reason)."""
    for name, reason in why.items():
        degree = getattr(cfg.parallelism, name)
        if degree > 1:
            yield f"--parallelism.{name} {degree}: the {objective} objective {reason}; use 1"


def validate_reward(cfg: Any) -> Iterator[str]:
    if (center := cfg.reward.center_rewards_coefficient) < 0:
        yield f"--reward.center_rewards_coefficient must be >= 0 (0 turns it off), got {center}"
    if cfg.training.objective != "reward":
        return
    yield from _unsupported_layouts(
        cfg,
        "reward",
        {
            "tensor_parallel_degree": "has a one-output score head, with no vocabulary to shard (FSDP and PP work)",
            "context_parallel_degree": "reads each score at its sequence's last token, which one rank alone holds",
        },
    )


def validate_kd(cfg: Any) -> Iterator[str]:
    kd = cfg.kd
    if not 0 <= kd.alpha <= 1:
        yield f"--kd.alpha must be in [0, 1] (0: SFT, 1: distillation alone), got {kd.alpha}"
    if not kd.temperature > 0:
        yield f"--kd.temperature must be > 0, got {kd.temperature}"
    if not 0 <= kd.beta <= 1:
        yield f"--kd.beta must be in [0, 1], got {kd.beta}"
    if kd.chunk_size < 1:
        yield f"--kd.chunk_size must be >= 1, got {kd.chunk_size}"
    if cfg.training.objective != "kd":
        return
    if not kd.teacher_path:
        yield "--kd.teacher_path is required: the teacher's Hugging Face folder or titanium checkpoint step folder"
