"""GRPO in the loop: group-relative advantages of rollouts from the rollout source, and the loss of
``titanium.objectives.losses.grpo`` on the response tokens.

B responses (prompts x group_size, each group's responses contiguous), T response positions. Each response's
advantage compares its reward with the others of its group; the loss family (grpo, dapo, dr_grpo, bnpo, gspo,
cispo; a clipped ratio objective plus beta x k3 KL to a reference) is in ``losses.grpo``.

The rollouts, their engine and its weight sync, the policy lag, dynamic sampling, the rewards and the reference
come from ``titanium.rl.source.RolloutSource`` (``[rl]``, ``[rollout]``). What is GRPO's: the advantages, the old
log-probs (the engine's, or recomputed by the trained policy with importance weights for the gap) and the loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from titanium.batch import Batch, Fields, per_row, per_token
from titanium.config.loader import ConfigError
from titanium.config.sections import DataSection, EnvironmentSection, GRPOSection, RLSection, RolloutSection
from titanium.generation.sampling import masked_entropy_sum
from titanium.model_builder import ModelSource
from titanium.objectives.base import (
    JobFacts,
    LossResult,
    Metrics,
    ModelOutput,
    ObjectiveContext,
    Prepared,
)
from titanium.objectives.grpo_correction import importance_weights, mismatch_metrics
from titanium.objectives.losses.grpo import LossType, grpo_loss, loss_mask, loss_units
from titanium.objectives.sourced import SourcedObjective
from titanium.rl.rollout import response_parts, rollout_images, trained_logprobs
from titanium.rl.source import Draw, RolloutSource, Scored, frozen_sources


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale: Literal["group", "batch", "none"] = "group",
    eps: float = 1e-4,
    batch_std: float | None = None,
) -> torch.Tensor:
    """``[B]`` advantages: each reward minus the mean of its group of ``group_size`` contiguous responses,
    divided by the group's standard deviation (``group``), that of the whole batch (``batch``: ``batch_std``,
    by default that of ``rewards``), or not at all (``none``); ``eps`` keeps a group of equal rewards at 0.
    Standard deviations are unbiased (n - 1), as in the reference implementations."""
    grouped = rewards.float().view(-1, group_size)
    advantages = grouped - grouped.nanmean(dim=1, keepdim=True)
    if scale == "group":
        advantages = advantages / (nanstd(grouped, dim=1) + eps)
    elif scale == "batch":
        advantages = advantages / ((nanstd(grouped) if batch_std is None else batch_std) + eps)
    elif scale != "none":
        raise ValueError(f"unknown reward scaling {scale!r}")
    # A response no reward function applies to (NaN: each returned None) is left out of its group's numbers and gets
    # no advantage, as in TRL.
    return advantages.flatten().nan_to_num(0.0)


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The unbiased standard deviation of the values that are not NaN (over ``dim``, keeping it; None: all)."""
    kept = ~values.isnan()
    n = kept.sum(dim=dim, keepdim=dim is not None)
    mean = values.nansum(dim=dim, keepdim=dim is not None) / n.clamp(min=1)
    squares = torch.where(kept, (values - mean) ** 2, 0.0).sum(dim=dim, keepdim=dim is not None)
    return (squares / (n - 1).clamp(min=1)).sqrt()


def check_pipeline_rows(cfg: GRPOSection, local_batch_size: int, pipeline_microbatch_size: int | None) -> None:
    """bnpo averages each microbatch's token mean: a pipeline microbatch (``pipeline_microbatch_size`` rows; None
    without pipeline parallelism) must not split it."""
    if cfg.loss_type == "bnpo" and pipeline_microbatch_size is not None and pipeline_microbatch_size < local_batch_size:
        raise ConfigError(
            "--grpo.loss_type bnpo averages each microbatch's token mean, and a pipeline microbatch "
            f"({pipeline_microbatch_size} rows) splits it: set --parallelism.pipeline_parallel_microbatch_size "
            f"{local_batch_size} or use another loss_type (dapo weighs every token the same)"
        )


def batch_reward_std(rewards: torch.Tensor, sum_over_data: Any) -> float:
    """Unbiased standard deviation of the rewards of every data-parallel rank's rollout batch (``sum_over_data``:
    ``ObjectiveContext.sum_over_data``), so that ``scale_rewards = "batch"`` does not depend on how the batch is
    split over ranks. (Under fault tolerance: one replica group's batches.)"""
    r = rewards.double()
    r, n = r.nan_to_num(0.0), (~r.isnan()).sum().double()  # (responses no reward applies to are left out)
    stats = sum_over_data(torch.stack([n, r.sum(), (r * r).sum()]))
    n, total, squares = stats.tolist()
    return math.sqrt(max(squares - total * total / n, 0.0) / max(n - 1, 1))


@dataclass
class RolloutFields(Fields):
    """A microbatch of rollouts' own fields: per response, its response tokens' old and reference log-probs,
    which of them carry loss, and its advantage (the prompt and response tokens are the batch's core)."""

    old_logprobs: torch.Tensor = per_row()
    """``[B, T]`` under the policy that sampled them."""
    loss_mask: torch.Tensor = per_row()
    """``[B, T]`` the response tokens that carry loss."""
    advantages: torch.Tensor = per_row()
    ref_logprobs: torch.Tensor | None = per_row(default=None)
    """``[B, T]`` under the frozen reference (beta > 0)."""
    is_weights: torch.Tensor | None = per_row(default=None)
    """``[B, T]`` or ``[B, 1]`` importance weights for the engine/trainer mismatch (``is_correction``)."""
    loss_type: LossType = "dapo"
    """What a loss unit is (``titanium.objectives.losses.grpo.loss_units``)."""
    max_new_tokens: int = 0
    targets: torch.Tensor | None = per_token(default=None)
    """Under context parallelism: the next token at each position (``titanium.rl.rollout.split_ready``)."""
    slots: torch.Tensor | None = per_token(default=None)
    """Under context parallelism: the response slot of that next token (-1: none)."""

    def units(self) -> torch.Tensor:
        return loss_units(self.loss_mask, self.loss_type, self.max_new_tokens)


MISMATCH_METRICS = (
    "grpo/logprob_mismatch",
    "grpo/logprob_mismatch_max",
    "grpo/is_weight",
    "grpo/is_weight_sq",
    "grpo/is_changed",
    "grpo/is_weight_max",
    "grpo/is_weight_min",
)
"""The engine/trainer gap with ``old_logprobs = "recompute"`` (the first two), and the importance weights'
(``titanium.objectives.grpo_correction.mismatch_metrics``), of the rollout batch first used at a step (recomputed
then: with a policy lag the gap includes the updates since the engine sampled it)."""

LOSS_UNITS: dict[str, str] = {
    "dapo": "tokens",
    "cispo": "tokens",
    "grpo": "responses",
    "gspo": "responses",
    "dr_grpo": "response slots",
    "bnpo": "microbatches",
}
"""What each loss type's loss is a mean over, for logs."""


def rollout_batch(rows: dict[str, torch.Tensor], cfg: GRPOSection, max_new_tokens: int) -> Batch[RolloutFields]:
    fields = RolloutFields(
        rows["old_logprobs"],
        rows["loss_mask"],
        rows["advantages"],
        rows.get("ref_logprobs"),
        rows.get("is_weights"),
        cfg.loss_type,
        max_new_tokens,
        rows.get("targets"),
        rows.get("slots"),
    )
    core = {"positions": rows["positions"], "document_ids": rows["document_ids"], "images": rollout_images(rows)}
    return Batch(rows["tokens"], fields, **core)


class GRPOObjective(SourcedObjective):
    """GRPO in the loop: rollouts from the rollout source in ``prepare``, the clipped loss on response tokens.

    ``training.local_batch_size`` counts responses per microbatch (a multiple of ``group_size``, so groups
    stay whole); a step trains on ``global_batch_size`` responses. A rollout batch holds ``minibatches``
    steps' worth of responses per rank, made in one generation call and served for ``ppo_epochs x
    minibatches`` consecutive optimizer steps (the same minibatches in the same order each epoch). Old
    log-probs are the engine's (``old_logprobs = "sampler"``) or a forward of the trained policy before the
    batch's first step (``"recompute"``); either way the ratio starts near 1 and moves away after. A batch's rows
    (advantages, old and reference log-probs, importance weights) are made at its first use, in the loop's thread
    (they may be collective); with ``--rl.max_policy_lag`` > 0 it was generated while earlier steps trained.

    Under context parallelism each rank trains on its part of every row (``split_ready``), and the responses'
    log-probs are completed over the cp group before the loss (``whole_responses``). ``next_microbatch`` hands out
    empty batches: the rows are made in ``prepare``.
    """

    trl_metric_names = {
        "grpo/reward": "reward",
        "grpo/reward_std": "reward_std",
        "grpo/response_len": "completions/mean_length",
        "grpo/kl": "kl",
        "grpo/entropy": "entropy",
        "grpo/clip_frac": "clip_ratio",
        "grpo/zero_std_frac": "frac_reward_zero_std",
        "grpo/reward/": "rewards/{}/mean",
    }

    loss_spikes = False  # (the loss sits near 0, of either sign: a ratio to its running mean is noise)

    @classmethod
    def frozen_sources(
        cls, section: GRPOSection, start: ModelSource, vocab_size: int | None, seq_len: int, **more: Any
    ) -> list[ModelSource]:
        rl = more.get("rl") or RLSection()
        return frozen_sources(rl, start, vocab_size, seq_len, reference=section.beta > 0)

    @classmethod
    def check_config(cls, section: GRPOSection, job: JobFacts, **more: Any) -> None:
        """Beyond the models it builds from folders: its rollout source (rewards, engine) and that a pipeline
        microbatch keeps what the loss averages over."""
        super().check_config(section, job, **more)
        check_pipeline_rows(section, job.local_batch_size, job.pipeline_microbatch_size)

    def __init__(
        self,
        ctx: ObjectiveContext,
        data: DataSection,
        cfg: GRPOSection,
        rl: RLSection | None = None,
        rollout: RolloutSection | None = None,
        environment: EnvironmentSection | None = None,
    ) -> None:
        """``rl``, ``rollout`` and ``environment``: the rollout source's sections (``[rl]``, ``[rollout]``,
        ``[environment]``; defaults when not given), registered with the objective (titanium/config/components.py)."""
        assert ctx.local_batch_size % cfg.group_size == 0, "whole groups per microbatch (config validation)"
        self.cfg, self.rl, self.device = cfg, rl or RLSection(), ctx.device
        self.placement, self.sum_over_data = ctx.placement, ctx.sum_over_data
        self.loss_unit = LOSS_UNITS[cfg.loss_type]
        row_metrics = ("grpo/reward", "grpo/reward_std")
        draw = Draw("grpo", cfg.group_size, cfg.ppo_epochs, cfg.minibatches, cfg.beta > 0, row_metrics)
        self.source = RolloutSource(ctx, data, self.rl, rollout or RolloutSection(), draw, environment)
        token_metrics = ("grpo/entropy", "grpo/clip_frac", *(("grpo/kl",) if cfg.beta > 0 else ()))
        mismatch = MISMATCH_METRICS if cfg.old_logprobs == "recompute" else ()
        if cfg.is_correction == "none":
            mismatch = mismatch[:2]
        self.metric_names = (*self.source.metric_names, *token_metrics, *mismatch)

    # ----- rollouts, made in prepare -----

    def prepare(self, microbatches: list[Batch]) -> Prepared:
        parts, metrics = self.source.next_step(len(microbatches), self._rows)
        max_new_tokens = self.rl.max_new_tokens
        return Prepared([self.placement.place(rollout_batch(p, self.cfg, max_new_tokens)) for p in parts], metrics)

    def _rows(self, scored: Scored) -> Metrics:
        """A batch's GRPO columns at its first use: advantages, loss mask, old and reference log-probs, importance
        weights, and the per-response reward metrics."""
        cfg, rows, out = self.cfg, scored.rows, scored.rollout
        rewards = out.rewards.total.to(self.device)
        batch_std = batch_reward_std(rewards, self.sum_over_data) if cfg.scale_rewards == "batch" else None
        advantages = group_advantages(rewards, cfg.group_size, cfg.scale_rewards, batch_std=batch_std)
        self.source.keep(scored, {"reward": rewards, "advantage": advantages})
        std = nanstd(rewards.float().view(-1, cfg.group_size), dim=1).flatten().repeat_interleave(cfg.group_size)
        mask = rows["response_mask"]
        rows.update(
            {
                "old_logprobs": out.old_logprobs.to(self.device),
                "loss_mask": loss_mask(mask, out.finished.to(self.device), cfg.mask_truncated),
                "advantages": advantages,
                "grpo/reward": rewards.float(),
                "grpo/reward_std": std,
            }
        )
        metrics: Metrics = {}
        if cfg.old_logprobs == "recompute":
            sampling = rows["old_logprobs"]
            rows["old_logprobs"] = self.source.policy_logprobs(rows) * mask
            metrics.update(self._mismatch(rows, sampling, mask))
        if self.source.reference is not None:
            rows["ref_logprobs"] = self.source.reference_logprobs(rows)
        return metrics

    def _mismatch(self, rows: dict[str, torch.Tensor], sampling: torch.Tensor, response_mask: torch.Tensor) -> Metrics:
        """Importance weights for the engine/trainer gap (stored as a row key) and the gap's metrics: means as
        (sum, count), maxima and minima over every rank (reduced here, then counted once per rank)."""
        cfg, mask = self.cfg, rows["loss_mask"]
        weights = None
        if cfg.is_correction != "none":
            old = rows["old_logprobs"]
            weights = importance_weights(old, sampling, response_mask, cfg.is_correction, cfg.is_cap, cfg.is_cap_min)
            rows["is_weights"] = weights
        means, maxima, minima = mismatch_metrics(rows["old_logprobs"], sampling, mask, weights)
        extremes = torch.stack([*maxima.values(), *(-v for v in minima.values())])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        one = torch.ones((), device=self.device)
        out: Metrics = dict(means)
        for name, value in zip(maxima, extremes):
            out[name] = (value, one)
        for name, value in zip(minima, extremes[len(maxima) :]):
            out[name] = (-value, one)
        return out

    # ----- the loss -----

    def loss(self, output: ModelOutput, batch: Batch[RolloutFields]) -> LossResult:
        assert output.logits is not None
        fields, temperature = batch.fields, self.rl.temperature
        width, mask, parts = fields.old_logprobs.shape[1], fields.loss_mask, response_parts(fields)
        logits, logprobs, slots = trained_logprobs(
            output.logits, batch.tokens, width, parts, self.placement, temperature
        )
        loss_sum, _, sums = grpo_loss(
            logprobs,
            fields.old_logprobs,
            fields.advantages,
            mask,
            self.cfg,
            fields.ref_logprobs,
            fields.is_weights,
            max_new_tokens=fields.max_new_tokens,
        )
        tokens = sums["tokens"]
        with torch.no_grad():
            local_mask = mask if slots is None else mask[:, slots]
            entropy = self.placement.add_parts(masked_entropy_sum(logits, local_mask, temperature))
        metrics = {
            "grpo/entropy": (entropy, tokens),
            "grpo/clip_frac": (sums["clipped_low"] + sums["clipped_high"], tokens),
        }
        if "kl" in sums:
            metrics["grpo/kl"] = (sums["kl"], tokens)
        return LossResult(loss_sum, metrics)

    def check_layout(self, pipeline_microbatch_size: int | None) -> None:
        check_pipeline_rows(self.cfg, self.source.local_batch_size, pipeline_microbatch_size)
