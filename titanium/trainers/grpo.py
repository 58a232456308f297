"""GRPO in the loop: group-relative advantages, rollouts made in the prepare phase, and the loss of
``titanium.trainers.grpo_loss`` on the response tokens.

B responses (prompts x group_size, each group's responses contiguous), T response positions. Each response's
advantage compares its reward with the others of its group; the loss family (grpo, dapo, dr_grpo, bnpo, gspo,
cispo; a clipped ratio objective plus beta x k3 KL to a reference) is in ``grpo_loss``.

``GRPOObjective`` runs them in the loop: rollouts from the live policy in the prepare phase, old log-probs
from the sampler, reference log-probs from a frozen copy (beta > 0), ppo_epochs x minibatches optimizer
steps per rollout batch, and a bounded policy lag.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from titanium.batch import Batch, Fields, empty_batch, per_row
from titanium.config.loader import ConfigError
from titanium.config.sections import DataSection, GRPOSection
from titanium.data.chat import build_chat_template
from titanium.data.prompts import PromptDataset, PromptSample
from titanium.generation.generate import all_ranks_done
from titanium.generation.rollout import Rollout, batch_logprobs, response_logprobs, rollout
from titanium.generation.rollout_buffer import RolloutBatch, RolloutQueue
from titanium.generation.sampling import SamplingParams
from titanium.rewards import RewardSet, exact_match
from titanium.trainers.base import (
    FrozenModel,
    LossResult,
    Metrics,
    ModelOutput,
    Objective,
    ObjectiveContext,
    Prepared,
)
from titanium.trainers.grpo_loss import LossType, grpo_loss, loss_mask, loss_units


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
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        advantages = advantages / ((grouped.std() if batch_std is None else batch_std) + eps)
    elif scale != "none":
        raise ValueError(f"unknown reward scaling {scale!r}")
    return advantages.flatten()


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy ``[...]`` of the temperature-scaled next-token distributions of ``logits`` ``[..., V]`` (a metric:
    call it under ``no_grad``; it holds one more ``[..., V]`` float32 tensor)."""
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    logp = torch.log_softmax(scaled, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def masked_entropy_sum(logits: torch.Tensor, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """Sum of ``token_entropy`` over the masked positions of ``logits`` ``[B, T, V]``, one row at a time (a
    metric: it never holds more than one row's ``[T, V]`` temporaries)."""
    total = torch.zeros((), device=logits.device)
    for row in range(logits.shape[0]):
        total += (token_entropy(logits[row], temperature) * mask[row]).sum()
    return total


def rollout_seed(seed: int, dp_rank: int, index: int) -> int:
    """The sampling seed of a rank's ``index``-th rollout batch: reproducible, and the same again when a resumed
    run makes that batch anew."""
    return hash((seed, dp_rank, index)) & 0x7FFF_FFFF_FFFF_FFFF


def batch_reward_std(rewards: torch.Tensor, device: torch.device, dp_world: int) -> float:
    """Unbiased standard deviation of the rewards of every data-parallel rank's rollout batch, so that
    ``scale_rewards = "batch"`` does not depend on how the batch is split over ranks."""
    r = rewards.double()
    stats = torch.stack([torch.tensor(float(r.numel()), dtype=torch.float64), r.sum(), (r * r).sum()]).to(device)
    if dp_world > 1:
        dist.all_reduce(stats)
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
    loss_type: LossType = "dapo"
    """What a loss unit is (``titanium.trainers.grpo_loss.loss_units``)."""
    max_new_tokens: int = 0

    def units(self) -> torch.Tensor:
        return loss_units(self.loss_mask, self.loss_type, self.max_new_tokens)


LOSS_UNITS: dict[str, str] = {
    "dapo": "tokens",
    "cispo": "tokens",
    "grpo": "responses",
    "gspo": "responses",
    "dr_grpo": "response slots",
    "bnpo": "microbatches",
}
"""What each loss type's loss is a mean over, for logs."""


def rollout_batch(rows: dict[str, torch.Tensor], cfg: GRPOSection) -> Batch[RolloutFields]:
    fields = RolloutFields(
        rows["old_logprobs"],
        rows["loss_mask"],
        rows["advantages"],
        rows.get("ref_logprobs"),
        cfg.loss_type,
        cfg.max_new_tokens,
    )
    return Batch(rows["tokens"], fields, positions=rows["positions"], document_ids=rows["document_ids"])


class GRPOObjective(Objective):
    """GRPO in the loop: rollouts from the live policy in ``prepare``, the clipped loss on response tokens.

    ``training.local_batch_size`` counts responses per microbatch (a multiple of ``group_size``, so groups
    stay whole); a step trains on ``global_batch_size`` responses. A rollout batch holds ``minibatches``
    steps' worth of responses per rank, made in one generation call and served for ``ppo_epochs x
    minibatches`` consecutive optimizer steps (the same minibatches in the same order each epoch). Old
    log-probs are the sampler's (the policy that made the rollouts), so the ratio is 1 at the first step on a
    batch and moves away from 1 after. With ``max_policy_lag`` > 0 the next batch is made while the current
    one is still being trained on, as early as its lag at first use allows; a queued batch that would be
    staler is dropped (``grpo/stale_rollouts_dropped``).

    ``next_microbatch`` hands out empty batches: the rows are made in ``prepare``. A checkpoint holds the
    prompt position before the batches in flight, which are not saved: a resumed run makes them again from
    the same prompts with the same sampling seeds (with the policy as saved).
    """

    loss_spikes = False  # (the loss sits near 0, of either sign: a ratio to its running mean is noise)

    def __init__(self, ctx: ObjectiveContext, data: DataSection, cfg: GRPOSection) -> None:
        if ctx.models is None:
            raise ValueError("GRPO generates with the live policy: the loop must hand it (ObjectiveContext.models)")
        assert ctx.local_batch_size % cfg.group_size == 0, "whole groups per microbatch (config validation)"
        self.cfg, self.policy, self.device = cfg, ctx.models.policy(), ctx.device
        self.loss_unit = LOSS_UNITS[cfg.loss_type]
        self.tokenizer, self.local_batch_size = ctx.tokenizer, ctx.local_batch_size
        self.seed, self.dp_rank, self.dp_world = ctx.seed, ctx.dp_rank, ctx.dp_world
        template = None
        if data.kind != "text":  # plain prompts for base models have no chat format
            template = build_chat_template(ctx.chat.chat_template, ctx.tokenizer, ctx.model_name)
        self.stop_ids = set(template.stop_ids) if template is not None else {ctx.tokenizer.eos_id}
        prompts = PromptDataset(data, cfg, ctx.tokenizer, template, ctx.chat.system_prompt, ctx.dp_rank, ctx.dp_world)
        self.prompts = prompts
        self._prompt_stream: Iterator[PromptSample] | None = None
        self.rewards = RewardSet.from_config(cfg)
        self.params = SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k)
        self.all_done = all_ranks_done(None, ctx.device) if ctx.dp_world > 1 else None  # (data parallelism only)
        # beta = 0 builds no reference model
        self.reference: FrozenModel | None = ctx.models.frozen() if cfg.beta > 0 else None
        self.row_metrics = (
            "grpo/reward",
            "grpo/reward_std",
            *(f"grpo/reward/{name}" for name in cfg.rewards),
            *(("grpo/accuracy",) if cfg.answer_column else ()),
            "grpo/response_len",
            "grpo/truncated",
        )
        token_metrics = ("grpo/entropy", "grpo/clip_frac", *(("grpo/kl",) if cfg.beta > 0 else ()))
        self.metric_names = (*self.row_metrics, "grpo/policy_lag", *token_metrics, "grpo/gen_tokens_per_s")
        self.queue = RolloutQueue(cfg.max_policy_lag)
        self.current: RolloutBatch | None = None
        self.version = 0  # optimizer steps taken (each prepare is followed by one)
        self.batches_made = 0

    # ----- data: empty batches out, rollouts made in prepare -----

    def next_microbatch(self) -> Batch:
        return empty_batch()

    def prepare(self, microbatches: list[Batch]) -> Prepared:
        made: list[RolloutBatch] = []
        if self.current is None or self.current.steps_left == 0:
            self.current = self.queue.pop_fresh(self.version)
            if self.current is None:
                self.current = self._make_batch(len(microbatches))
                made.append(self.current)
        current = self.current
        lag = self.version - current.version
        parts = current.next_step(len(microbatches))
        # The next batch's lag at its first use is the steps left on this one, plus one.
        if not self.queue and current.steps_left < self.cfg.max_policy_lag:
            made.append(self._make_batch(len(microbatches)))
            self.queue.put(made[-1])
        self.version += 1
        return Prepared([rollout_batch(part, self.cfg) for part in parts], self._metrics(parts, lag, made))

    def _metrics(self, parts: list[dict[str, torch.Tensor]], lag: int, made: list[RolloutBatch]) -> Metrics:
        """The step's per-response metrics (sums over its responses), its policy lag, and the generation
        throughput of the batches made with it."""
        responses = torch.tensor(float(sum(part["tokens"].shape[0] for part in parts)), device=self.device)
        metrics = {name: (sum(part[name].sum() for part in parts), responses) for name in self.row_metrics}
        metrics["grpo/policy_lag"] = (lag * responses, responses)
        if made:
            generated = torch.tensor(float(sum(b.generated_tokens for b in made)), device=self.device)
            seconds = torch.tensor(sum(b.generation_seconds for b in made), device=self.device)
            metrics["grpo/gen_tokens_per_s"] = (generated, seconds)
        return metrics

    def sample(self, model: nn.Module, samples: list[PromptSample], index: int) -> Rollout:
        """``group_size`` sampled responses to each of ``samples`` from ``model`` (the live policy), for this
        rank's ``index``-th rollout batch."""
        generator = torch.Generator(self.device).manual_seed(rollout_seed(self.seed, self.dp_rank, index))
        return rollout(
            model,
            samples,
            self.cfg.group_size,
            self.params,
            self.rewards,
            self.tokenizer,
            self.stop_ids,
            generator=generator,
            all_done=self.all_done,
            device=self.device,
        )

    def _next_prompts(self, n: int) -> list[PromptSample]:
        if self._prompt_stream is None:
            self._prompt_stream = iter(self.prompts)
        return [next(self._prompt_stream) for _ in range(n)]

    def _make_batch(self, microbatches: int) -> RolloutBatch:
        """Sample the next rollout batch with the current policy: advantages, loss mask, reference log-probs
        and the per-response metrics, all as rows on the device."""
        cfg = self.cfg
        resume_point = {"prompts": self.prompts.state_dict(), "batches_made": self.batches_made}
        samples = self._next_prompts(microbatches * self.local_batch_size * cfg.minibatches // cfg.group_size)
        start = time.perf_counter()
        with self.policy.lend() as model:
            out = self.sample(model, samples, self.batches_made)
        seconds = time.perf_counter() - start
        self.batches_made += 1

        rewards = out.rewards.total
        batch_std = batch_reward_std(rewards, self.device, self.dp_world) if cfg.scale_rewards == "batch" else None
        advantages = group_advantages(rewards, cfg.group_size, cfg.scale_rewards, batch_std=batch_std)
        lengths = out.response_mask.sum(dim=1)
        per_response = {
            "grpo/reward": rewards,
            "grpo/reward_std": rewards.float().view(-1, cfg.group_size).std(dim=1).repeat_interleave(cfg.group_size),
            **{f"grpo/reward/{name}": values for name, values in out.rewards.per_function.items()},
            "grpo/response_len": lengths,
            "grpo/truncated": ~out.finished,
        }
        if cfg.answer_column:
            answers = [s.answer for s in samples for _ in range(cfg.group_size)]
            per_response["grpo/accuracy"] = torch.tensor(
                [exact_match(c, a, {}) for c, a in zip(out.completions, answers)]
            )
        rows = {
            **out.model_inputs(),
            "old_logprobs": out.old_logprobs,
            "loss_mask": loss_mask(out.response_mask, out.finished, cfg.mask_truncated),
            "advantages": advantages,
            **{k: v.to(self.device, torch.float32) for k, v in per_response.items()},
        }
        rows = {k: v.to(self.device) for k, v in rows.items()}
        if self.reference is not None:
            rows["ref_logprobs"] = self._reference_logprobs(rows)
        return RolloutBatch(
            rows,
            version=self.version,
            minibatches=cfg.minibatches,
            epochs=cfg.ppo_epochs,
            resume_point=resume_point,
            generated_tokens=int(lengths.sum()),
            generation_seconds=seconds,
        )

    def _reference_logprobs(self, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """The frozen reference's log-probs of the response tokens, a microbatch of rows at a time."""
        assert self.reference is not None
        return batch_logprobs(
            self._reference_logits, rows, rows["old_logprobs"].shape[1], self.cfg.temperature, self.local_batch_size
        )

    def _reference_logits(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        assert self.reference is not None
        core = Batch(inputs["tokens"], Fields(), positions=inputs["positions"], document_ids=inputs["document_ids"])
        return self.reference(core)

    # ----- the loss -----

    def loss(self, output: ModelOutput, batch: Batch[RolloutFields]) -> LossResult:
        assert output.logits is not None
        fields, temperature = batch.fields, self.cfg.temperature
        width, mask = fields.old_logprobs.shape[1], fields.loss_mask
        logprobs = response_logprobs(output.logits, batch.tokens, width, temperature)
        loss_sum, _, sums = grpo_loss(
            logprobs, fields.old_logprobs, fields.advantages, mask, self.cfg, fields.ref_logprobs
        )
        tokens = sums["tokens"]
        with torch.no_grad():
            entropy = masked_entropy_sum(output.logits[:, -width - 1 : -1], mask, temperature)
        metrics = {
            "grpo/entropy": (entropy, tokens),
            "grpo/clip_frac": (sums["clipped_low"] + sums["clipped_high"], tokens),
        }
        if "kl" in sums:
            metrics["grpo/kl"] = (sums["kl"], tokens)
        return LossResult(loss_sum, metrics)

    def check_layout(self, pipeline_microbatch_size: int | None) -> None:
        if pipeline_microbatch_size is not None:
            raise ConfigError("--training.objective grpo generates with the whole model: no pipeline parallelism")

    # ----- log and checkpoint -----

    def log_metrics(self) -> dict[str, float]:
        counters = {
            "data/skipped_rows": self.prompts.bad_rows,
            "grpo/long_prompts_skipped": self.prompts.too_long,
            "grpo/stale_rollouts_dropped": self.queue.dropped,
        }
        return {k: float(v) for k, v in counters.items() if v}

    def state_dict(self) -> dict[str, Any]:
        """The prompt position before the oldest rollout batch still in flight (or the current one)."""
        in_flight = [b for b in (self.current, *self.queue.batches) if b is not None and b.steps_left > 0]
        if in_flight:
            return dict(in_flight[0].resume_point)
        return {"prompts": self.prompts.state_dict(), "batches_made": self.batches_made}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.batches_made = state["batches_made"]
        self._prompt_stream, self.current = None, None
        self.queue.clear()
