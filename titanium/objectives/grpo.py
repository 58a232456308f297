"""GRPO in the loop: group-relative advantages, rollouts made in the prepare phase, and the loss of
``titanium.objectives.losses.grpo`` on the response tokens.

B responses (prompts x group_size, each group's responses contiguous), T response positions. Each response's
advantage compares its reward with the others of its group; the loss family (grpo, dapo, dr_grpo, bnpo, gspo,
cispo; a clipped ratio objective plus beta x k3 KL to a reference) is in ``grpo_loss``.

``GRPOObjective`` runs them in the loop: rollouts from a rollout engine with its own copy of the policy
(``[rollout]``, refreshed after every optimizer step through the policy handle's ``on_update``), old log-probs
from the engine or recomputed by the trained policy (with importance weights for the gap), reference log-probs
from a frozen copy (beta > 0), ppo_epochs x minibatches optimizer steps per rollout batch, and a bounded
policy lag (the next batch generated on a thread while the step trains: ``titanium.generation.background``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanium.batch import Batch, Fields, empty_batch, per_row, per_token
from titanium.config.loader import ConfigError
from titanium.config.sections import DataSection, GRPOSection, RolloutSection
from titanium.data.chat import build_chat_template
from titanium.data.kinds import first_columns
from titanium.data.prompts import PromptDataset, PromptSample
from titanium.generation.background import GenerationWorker
from titanium.generation.engine import SyncStats, build_engine
from titanium.generation.sampling import SamplingParams, token_logprobs
from titanium.metrics.table import Table
from titanium.model_builder import ModelSource
from titanium.objectives.base import (
    FrozenModel,
    LossResult,
    Metrics,
    ModelOutput,
    Objective,
    ObjectiveContext,
    Prepared,
    row_width,
)
from titanium.objectives.grpo_correction import importance_weights, mismatch_metrics
from titanium.objectives.losses.grpo import LossType, grpo_loss, loss_mask, loss_units
from titanium.rl.buffer import PendingBatch, RolloutBatch, RolloutQueue
from titanium.rl.completions import CompletionsLog
from titanium.rl.dynamic import DYNAMIC_METRICS, SampledBatch, sample_batch
from titanium.rl.rewards.functions import (
    Rewards,
    RewardSet,
    TrainerState,
    exact_match,
    names_reward_model,
    reward_labels,
)
from titanium.rl.rewards.scores import placed_chunks, reward_model_scores, scalar_head_source, score_positions
from titanium.rl.rollout import (
    ResponseTargets,
    Rollout,
    batch_logprobs,
    check_peers_agree,
    from_last_stage,
    local_responses,
    narrow,
    split_ready,
    to_rollout,
    whole_responses,
)

logger = logging.getLogger(__name__)


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
        advantages = advantages / (_nanstd(grouped, dim=1) + eps)
    elif scale == "batch":
        advantages = advantages / ((_nanstd(grouped) if batch_std is None else batch_std) + eps)
    elif scale != "none":
        raise ValueError(f"unknown reward scaling {scale!r}")
    # A response no reward function applies to (NaN: each returned None) is left out of its group's numbers and gets
    # no advantage, as in TRL.
    return advantages.flatten().nan_to_num(0.0)


def _nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The unbiased standard deviation of the values that are not NaN (over ``dim``, keeping it; None: all)."""
    kept = ~values.isnan()
    n = kept.sum(dim=dim, keepdim=dim is not None)
    mean = values.nansum(dim=dim, keepdim=dim is not None) / n.clamp(min=1)
    squares = torch.where(kept, (values - mean) ** 2, 0.0).sum(dim=dim, keepdim=dim is not None)
    return (squares / (n - 1).clamp(min=1)).sqrt()


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
    """The sampling seed of a rank's ``index``-th generation call (a rollout batch, or each round of one with
    dynamic sampling): reproducible, and the same again when a resumed run makes that batch anew."""
    return hash((seed, dp_rank, index)) & 0x7FFF_FFFF_FFFF_FFFF


def sharded_reward_models(
    cfg: GRPOSection, policy: Any, pad_id: int | None, vocab_size: int, seq_len: int
) -> dict[str, ModelSource]:
    """``--grpo.rewards`` folder -> its reward model's source, for ``reward_model_layout = "sharded"`` (built under
    the training's plan; ``policy``: the policy's source or handle, whose family it must be); none otherwise."""
    if cfg.reward_model_layout != "sharded":
        return {}
    folders = [name for name in cfg.rewards if names_reward_model(name)]
    if not folders:
        raise ConfigError("--grpo.reward_model_layout sharded: --grpo.rewards names no reward model folder to shard")
    return {
        name: scalar_head_source(policy.spec, name, "--grpo.rewards", pad_id, vocab_size, seq_len) for name in folders
    }


def batch_reward_std(rewards: torch.Tensor, device: torch.device, ranks_per_row: int) -> float:
    """Unbiased standard deviation of the rewards of every data-parallel rank's rollout batch, so that
    ``scale_rewards = "batch"`` does not depend on how the batch is split over ranks. Every rank of the job adds
    its batch; the ranks of one data-parallel rank (tensor, pipeline, context parallel) hold the same batch, so the
    sums count each ``ranks_per_row`` times. (Under fault tolerance: one replica group's batches.)"""
    r = rewards.double()
    r, n = r.nan_to_num(0.0), (~r.isnan()).sum().double()  # (responses no reward applies to are left out)
    stats = torch.stack([n, r.sum(), (r * r).sum()]).to(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stats)
        stats /= ranks_per_row
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
TIME_PARTS = ("generate", "wait", "reward_model", "old_logprobs", "reference", "sync", "train")
"""The step-time breakdown, in seconds per rank (``grpo/time/<part>``, means over ranks): generation (its own
seconds, on the generation thread or not), sharded reward models' scores, recomputed old log-probs and reference
log-probs of the batches first used at this step, the seconds the loop waited for generation since the last
prepare (all of ``generate`` when it runs in the loop's thread; 1 - wait / generate is the share of generation
hidden behind training), and the weight sync and training (forward, backward, optimizer step: from the end of
``prepare`` to the sync) of the step before it."""
GENERATION_TENSORS = ("tokens", "logprobs", "lengths", "finished")

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
        rows.get("is_weights"),
        cfg.loss_type,
        cfg.max_new_tokens,
        rows.get("targets"),
        rows.get("slots"),
    )
    return Batch(rows["tokens"], fields, positions=rows["positions"], document_ids=rows["document_ids"])


class GRPOObjective(Objective):
    """GRPO in the loop: rollouts from the rollout engine in ``prepare``, the clipped loss on response tokens.

    ``training.local_batch_size`` counts responses per microbatch (a multiple of ``group_size``, so groups
    stay whole); a step trains on ``global_batch_size`` responses. A rollout batch holds ``minibatches``
    steps' worth of responses per rank, made in one generation call and served for ``ppo_epochs x
    minibatches`` consecutive optimizer steps (the same minibatches in the same order each epoch). Old
    log-probs are the engine's (``old_logprobs = "sampler"``) or a forward of the trained policy before the
    batch's first step (``"recompute"``); either way the ratio starts near 1 and moves away after. With
    ``max_policy_lag`` > 0 the next batch's generation starts while the current one is still being trained on, as
    early as its lag at first use allows, on a generation thread when the engine allows one (``background``):
    generation overlaps the forward, backward and optimizer step, and the sync after the step waits for it, so a
    batch is made by one version of the weights and tagged with it. Its rows (advantages, old and reference
    log-probs, importance weights) are made at its first use, in the loop's thread (they may be collective). A
    queued batch that would be staler is dropped (``grpo/stale_rollouts_dropped``).

    The engine (``[rollout]``) holds its own copy of the policy: it is built here, gets the weights once they are
    in place (``after_load``: initialized, or resumed) and again after every optimizer step (the policy handle's
    ``on_update``), and every rank generates its own prompts alone. Every rank of one data-parallel rank (tensor,
    pipeline, context parallel) generates the same rows: same prompts, same seed, same synced weights. Under context
    parallelism each rank then trains on its part of every row (``split_ready``), and the responses' log-probs are
    completed over the cp group before the loss (``whole_responses``).

    ``next_microbatch`` hands out empty batches: the rows are made in ``prepare``. A checkpoint holds the
    prompt position before the batches in flight, which are not saved: a resumed run makes them again from
    the same prompts with the same sampling seeds (with the policy as saved).
    """

    loss_spikes = False  # (the loss sits near 0, of either sign: a ratio to its running mean is noise)

    @classmethod
    def frozen_sources(
        cls, section: GRPOSection, start: ModelSource, vocab_size: int, seq_len: int
    ) -> list[ModelSource]:
        reference = [start] if section.beta > 0 else []  # (the reference of the KL term)
        return [*reference, *sharded_reward_models(section, start, None, vocab_size, seq_len).values()]

    def __init__(
        self, ctx: ObjectiveContext, data: DataSection, cfg: GRPOSection, rollout: RolloutSection | None = None
    ) -> None:
        """``rollout``: the ``[rollout]`` section (the engine to generate with; its defaults when not given),
        registered with the objective (titanium/config/components.py)."""
        if ctx.models is None:
            raise ValueError("GRPO follows the live policy's weights: the loop must hand it (ObjectiveContext.models)")
        assert ctx.local_batch_size % cfg.group_size == 0, "whole groups per microbatch (config validation)"
        self.cfg, self.policy, self.device = cfg, ctx.models.policy(), ctx.device
        self.placement, self.sequence_multiple = ctx.placement, ctx.sequence_multiple
        self.loss_unit = LOSS_UNITS[cfg.loss_type]
        self.tokenizer, self.local_batch_size = ctx.tokenizer, ctx.local_batch_size
        pad_to, self.pad_multiple = row_width(cfg.pad_to, cfg.pad_multiple, ctx, "--grpo.pad_to")
        self.narrowed = pad_to == "longest" and not ctx.placement.split
        """Microbatches cut to the columns their rows use (rows split over context-parallel ranks keep their rollout
        batch's width, as with pad_to seq_len)."""
        self.seed, self.dp_rank, self.ranks_per_row = ctx.seed, ctx.dp_rank, ctx.ranks_per_row
        template = None
        if data.kind != "text":  # plain prompts for base models have no chat format
            template = build_chat_template(ctx.chat.chat_template, ctx.tokenizer, ctx.model_name)
        stop_ids = set(template.stop_ids) if template is not None else {ctx.tokenizer.eos_id}
        prompts = PromptDataset(data, cfg, ctx.tokenizer, template, ctx.chat.system_prompt, ctx.dp_rank, ctx.dp_world)
        self.prompts = prompts
        self._prompt_stream: Iterator[PromptSample] | None = None
        self.rewards = RewardSet.from_config(
            cfg,
            device=ctx.device,
            pad_id=ctx.tokenizer.pad_id,
            vocab_size=ctx.tokenizer.vocab_size,
            columns=first_columns(data)[0],  # (TRL's signature check of the reward functions, at start-up)
        )
        self.total_steps = ctx.total_steps
        self._reward_logs: dict[str, list[float]] = {}  # (TRL's log_metric, until the next log line)
        sharded = sharded_reward_models(cfg, self.policy, ctx.tokenizer.pad_id, ctx.vocab_size, ctx.seq_len)
        self.reward_models = {name: ctx.models.frozen(source=source) for name, source in sharded.items()}
        self.params = SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k)
        # beta = 0 builds no reference model
        self.reference: FrozenModel | None = ctx.models.frozen() if cfg.beta > 0 else None
        self.row_metrics = (
            "grpo/reward",
            "grpo/reward_std",
            *(f"grpo/reward/{label}" for label in reward_labels(cfg.rewards).values()),
            *(("grpo/accuracy",) if cfg.answer_column else ()),
            "grpo/response_len",
            "grpo/truncated",
        )
        token_metrics = ("grpo/entropy", "grpo/clip_frac", *(("grpo/kl",) if cfg.beta > 0 else ()))
        mismatch = MISMATCH_METRICS if cfg.old_logprobs == "recompute" else ()
        if cfg.is_correction == "none":
            mismatch = mismatch[:2]
        self.metric_names = (
            *self.row_metrics,
            "grpo/policy_lag",
            *token_metrics,
            "grpo/gen_tokens_per_s",
            *(DYNAMIC_METRICS if cfg.dynamic_sampling else DYNAMIC_METRICS[:1]),
            *mismatch,
            *(f"grpo/time/{part}" for part in TIME_PARTS),
        )
        self.queue = RolloutQueue(cfg.max_policy_lag)
        self.timeline: deque[tuple[str, int, float]] = deque(maxlen=64)
        """Recent (event, batch index or step, perf_counter) of generation and sync, to check the overlap."""
        self.current: RolloutBatch | None = None
        self.version = 0  # optimizer steps taken (each prepare is followed by one)
        self.batches_made = 0
        self._times: dict[str, float] = {}  # seconds spent since the last prepare, by TIME_PARTS
        self._prepared_at: float | None = None
        self.completions = CompletionsLog(
            "grpo/completions", cfg.log_completions, cfg.log_completions_count, ctx.tokenizer
        )
        self.engine = build_engine(
            rollout or RolloutSection(),
            self.policy.spec,
            self.policy.args,
            stop_ids=stop_ids,
            pad_id=ctx.tokenizer.pad_id,
            max_model_len=cfg.max_prompt_len + cfg.max_new_tokens,
            device=ctx.device,
            training_dtype=self.policy.param_dtype,
            seed=rollout_seed(ctx.seed, ctx.dp_rank, 0),
            tp_group=self.policy.tp_group,
        )
        self.worker = GenerationWorker(self.engine.background and cfg.max_policy_lag > 0, ctx.device)
        self.policy.on_update(self.sync)

    # ----- the engine follows the policy -----

    def sync(self, step: int) -> SyncStats:
        """Load the policy's weights after ``step`` optimizer steps into the engine (every rank together)."""
        if self._prepared_at is not None:  # the step's forward, backward and optimizer step
            self._times["train"] = self._times.get("train", 0.0) + time.perf_counter() - self._prepared_at
            self._prepared_at = None
        self.timeline.append(("sync", step, time.perf_counter()))
        self._times["wait"] = self._times.get("wait", 0.0) + self.worker.wait()  # (no generation under the sync)
        stats = self.engine.sync_from(self.policy.model, version=step, pp_group=self.policy.pp_group)
        self._times["sync"] = self._times.get("sync", 0.0) + stats.seconds
        self.version = step
        return stats

    def close(self) -> None:
        self.worker.close()
        self.engine.close()

    # ----- data: empty batches out, rollouts made in prepare -----

    def next_microbatch(self) -> Batch:
        return empty_batch()

    def prepare(self, microbatches: list[Batch]) -> Prepared:
        made: list[RolloutBatch] = []
        if self.current is None or self.current.steps_left == 0:
            pending = self.queue.pop_fresh(self.version) or self._start_batch(len(microbatches))
            self.current = self._finish_batch(pending)
            made.append(self.current)
        current = self.current
        lag = self.version - current.version
        parts = current.next_step(len(microbatches))
        if self.narrowed:  # the columns the microbatch's rows use: those the log-prob forwards of its rows used
            parts = [narrow(part, part["response_mask"], self.pad_multiple) for part in parts]
        # The next batch's lag at its first use is the steps left on this one, plus one.
        if not self.queue and current.steps_left < self.cfg.max_policy_lag:
            self.queue.put(self._start_batch(len(microbatches)))
        self.version += 1
        metrics = self._metrics(parts, lag, made)
        self._prepared_at = time.perf_counter()
        return Prepared([self.placement.place(rollout_batch(part, self.cfg)) for part in parts], metrics)

    def _metrics(self, parts: list[dict[str, torch.Tensor]], lag: int, made: list[RolloutBatch]) -> Metrics:
        """The step's per-response metrics (sums over its responses), its policy lag, the generation throughput
        and the engine/trainer mismatch of the batch first used at it, and the seconds since the last prepare."""
        responses = torch.tensor(float(sum(part["tokens"].shape[0] for part in parts)), device=self.device)
        metrics = {
            name: (sum(part[name].nansum() for part in parts), responses)  # (a reward function's: where it applies)
            if not name.startswith("grpo/reward/")
            else (sum(part[name].nansum() for part in parts), sum((~part[name].isnan()).sum() for part in parts))
            for name in self.row_metrics
        }
        metrics["grpo/policy_lag"] = (lag * responses, responses)
        if made:
            generated = torch.tensor(float(sum(b.generated_tokens for b in made)), device=self.device)
            seconds = torch.tensor(sum(b.generation_seconds for b in made), device=self.device)
            metrics["grpo/gen_tokens_per_s"] = (generated, seconds)
            for batch in made:
                for name, (total, count) in batch.metrics.items():
                    if name in metrics:
                        total, count = total + metrics[name][0], count + metrics[name][1]
                    metrics[name] = (total, count)
        one = torch.ones((), device=self.device)
        for part, seconds in self._times.items():  # means over ranks
            metrics[f"grpo/time/{part}"] = (torch.tensor(seconds, device=self.device), one)
        self._times = {}
        return metrics

    def sample(self, samples: list[PromptSample], index: int) -> tuple[Rollout, int]:
        """``group_size`` sampled responses to each of ``samples`` from the engine, for this rank's ``index``-th
        rollout batch, and the policy version that made them."""
        prompts = [s.prompt for s in samples for _ in range(self.cfg.group_size)]
        out = self.engine.generate(prompts, self.params, seed=rollout_seed(self.seed, self.dp_rank, index))
        generation = dataclasses.replace(
            out.generation, **{k: getattr(out.generation, k).to(self.device) for k in GENERATION_TENSORS}
        )
        trl_prompts = [s.trl_prompt for s in samples for _ in range(self.cfg.group_size)]
        state = TrainerState(global_step=out.version, max_steps=self.total_steps)
        rewards = self.rewards.with_tokens(prompts, generation.token_lists(keep_stop=True), trl_prompts, state)
        return to_rollout(samples, self.cfg.group_size, generation, rewards, self.tokenizer), out.version

    def _prompts_per_batch(self, microbatches: int) -> int:
        """Prompts of one rollout batch (one generation round) with ``microbatches`` microbatches a step."""
        return microbatches * self.local_batch_size * self.cfg.minibatches // self.cfg.group_size

    def _next_prompts(self, n: int) -> list[PromptSample]:
        if self._prompt_stream is None:
            self._prompt_stream = iter(self.prompts)
        return [next(self._prompt_stream) for _ in range(n)]

    def _timed(self, part: str, start: float) -> None:
        self._times[part] = self._times.get(part, 0.0) + time.perf_counter() - start

    def _start_batch(self, microbatches: int) -> PendingBatch:
        """Start sampling the next rollout batch with the engine (on the generation thread, or here at once).

        Its prompts (every round's, with dynamic sampling) and sampling seeds are drawn by the generation job
        itself: jobs run one at a time in the order started, so the prompt stream is read in the same order with
        a thread or without, and the whole batch is made by the engine's weights of one version (a sync waits for
        the job). Its resume point (the prompt position before it) is noted when the job starts."""
        cfg = self.cfg
        prompts = self._prompts_per_batch(microbatches)
        max_rounds = cfg.dynamic_sampling_max_rounds if cfg.dynamic_sampling else None
        resume_point: dict[str, Any] = {}

        def draw() -> tuple[list[PromptSample], Rollout, int]:  # one generation round
            samples, index = self._next_prompts(prompts), self.batches_made
            self.batches_made += 1
            return (samples, *self.sample(samples, index))

        def generate() -> tuple[SampledBatch, float]:
            start = time.perf_counter()
            resume_point.update(prompts=self.prompts.state_dict(), batches_made=self.batches_made)
            self.timeline.append(("generate", self.batches_made, start))
            sampled = sample_batch(draw, cfg.group_size, self.tokenizer.pad_id, max_rounds)
            self.timeline.append(("generated", resume_point["batches_made"], time.perf_counter()))
            return sampled, time.perf_counter() - start

        start = time.perf_counter()
        generation = self.worker.submit(generate)
        if not self.worker.background:  # (the loop waited for all of it)
            self._timed("wait", start)
        return PendingBatch(generation, self.engine.synced_version(), prompts * cfg.group_size, resume_point)

    def _finish_batch(self, pending: PendingBatch) -> RolloutBatch:
        """The rows of a started batch at its first use: advantages, loss mask, old and reference log-probs,
        importance weights and the per-response metrics, all on the device."""
        cfg = self.cfg
        start = time.perf_counter()
        sampled, seconds = pending.generation.result()
        samples, out, version = sampled.samples, sampled.rollout, sampled.version
        if self.ranks_per_row > 1:
            check_peers_agree(out.tokens, self.dp_rank)
        if self.worker.background:
            self._timed("wait", start)
        self._times["generate"] = self._times.get("generate", 0.0) + seconds

        inputs = {k: v.to(self.device) for k, v in out.model_inputs().items()}
        if self.placement.split:  # (each rank runs the models on its part of every row)
            inputs = split_ready(inputs, out.response_mask.shape[1], self.sequence_multiple, self.tokenizer.pad_id)
        if self.reward_models:
            out = dataclasses.replace(out, rewards=self._scored(inputs, out))
        rewards = out.rewards.total
        batch_std = batch_reward_std(rewards, self.device, self.ranks_per_row) if cfg.scale_rewards == "batch" else None
        advantages = group_advantages(rewards, cfg.group_size, cfg.scale_rewards, batch_std=batch_std)
        self.completions.keep(samples, out, {"reward": rewards, "advantage": advantages})
        for name, values in out.rewards.logged.items():
            self._reward_logs.setdefault(name, []).extend(values)
        lengths, labels = out.response_mask.sum(dim=1), reward_labels(cfg.rewards)
        per_response = {
            "grpo/reward": rewards,
            "grpo/reward_std": _nanstd(rewards.float().view(-1, cfg.group_size), dim=1)
            .flatten()
            .repeat_interleave(cfg.group_size),
            **{f"grpo/reward/{labels[name]}": values for name, values in out.rewards.per_function.items()},
            "grpo/response_len": lengths,
            "grpo/truncated": ~out.finished,
        }
        if cfg.answer_column:
            answers = [s.answer for s in samples for _ in range(cfg.group_size)]
            per_response["grpo/accuracy"] = torch.tensor(
                [exact_match(c, a, {}) for c, a in zip(out.completions, answers)]
            )
        rows = {
            **inputs,
            "old_logprobs": out.old_logprobs,
            "response_mask": out.response_mask,
            "loss_mask": loss_mask(out.response_mask, out.finished, cfg.mask_truncated),
            "advantages": advantages,
            **{k: v.to(self.device, torch.float32) for k, v in per_response.items()},
        }
        rows = {k: v.to(self.device) for k, v in rows.items()}
        metrics = sampled.metrics(self.device, cfg.dynamic_sampling)
        if cfg.old_logprobs == "recompute":
            start = time.perf_counter()
            sampling = rows["old_logprobs"]
            rows["old_logprobs"] = self._logprobs(self.policy.forward, rows) * out.response_mask
            self._timed("old_logprobs", start)
            metrics.update(self._mismatch(rows, sampling, out.response_mask))
        if self.reference is not None:
            start = time.perf_counter()
            rows["ref_logprobs"] = self._logprobs(self._reference_logits, rows)
            self._timed("reference", start)
        return RolloutBatch(
            rows,
            version=version,
            minibatches=cfg.minibatches,
            epochs=cfg.ppo_epochs,
            resume_point=pending.resume_point,
            generated_tokens=sampled.tokens_made,
            generation_seconds=seconds,
            metrics=metrics,
        )

    def _scored(self, inputs: dict[str, torch.Tensor], out: Rollout) -> Rewards:
        """``out``'s rewards completed with the sharded reward models' scores of its rows (``inputs``: their model
        inputs, split under CP), computed here by every rank together (``titanium.rl.rewards.scores``)."""
        start = time.perf_counter()
        mask = out.response_mask.to(self.device)
        chunks = placed_chunks(inputs, score_positions(inputs, mask), self.local_batch_size, self.placement)
        pp_group = self.policy.pp_group
        scores = {
            name: reward_model_scores(model, chunks, self.placement, pp_group, self.device)
            for name, model in self.reward_models.items()
        }
        self._timed("reward_model", start)
        return self.rewards.complete(out.rewards, scores)

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

    def _logprobs(self, forward: Callable[[dict[str, torch.Tensor]], torch.Tensor | None], rows) -> torch.Tensor:
        """``[B, T]`` log-probs of the responses under ``forward`` (a microbatch of rows at a time, narrowed to the
        columns its rows use with ``pad_to`` longest: the very columns its training microbatch keeps, so each of
        those holds a computed log-prob); under pipeline parallelism the last stage's, shared over the pipeline
        group."""
        width, mask = rows["loss_mask"].shape[1], rows["response_mask"] if self.narrowed else None
        out = batch_logprobs(
            forward, rows, width, self.cfg.temperature, self.local_batch_size, self.placement, mask, self.pad_multiple
        )
        return from_last_stage(out, rows["loss_mask"].shape, self.policy.pp_group, self.device)

    def _reference_logits(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        assert self.reference is not None
        core = Batch(inputs["tokens"], Fields(), positions=inputs["positions"], document_ids=inputs["document_ids"])
        return self.reference(core)

    # ----- the loss -----

    def loss(self, output: ModelOutput, batch: Batch[RolloutFields]) -> LossResult:
        assert output.logits is not None
        fields, temperature = batch.fields, self.cfg.temperature
        width, mask = fields.old_logprobs.shape[1], fields.loss_mask
        parts = None if fields.targets is None else ResponseTargets(fields.targets, fields.slots)
        # the response tokens' logits (at i predict token i + 1): of this rank's part under context parallelism
        logits, next_tokens, slots = local_responses(output.logits, batch.tokens, width, parts)
        if isinstance(logits, DTensor):  # vocabulary-sharded under loss parallel: the responses' rows made whole
            logits = logits.full_tensor()
        logprobs = whole_responses(token_logprobs(logits, next_tokens, temperature), slots, width, self.placement)
        loss_sum, _, sums = grpo_loss(
            logprobs, fields.old_logprobs, fields.advantages, mask, self.cfg, fields.ref_logprobs, fields.is_weights
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
        if (
            self.cfg.loss_type == "bnpo"
            and pipeline_microbatch_size is not None
            and pipeline_microbatch_size < self.local_batch_size
        ):
            raise ConfigError(
                "--grpo.loss_type bnpo averages each microbatch's token mean, and a pipeline microbatch "
                f"({pipeline_microbatch_size} rows) splits it: set --parallelism.pipeline_parallel_microbatch_size "
                f"{self.local_batch_size} or use another loss_type (dapo weighs every token the same)"
            )

    # ----- log and checkpoint -----

    def log_metrics(self) -> dict[str, float]:
        counters = {
            "data/skipped_rows": self.prompts.bad_rows,
            "grpo/long_prompts_skipped": self.prompts.too_long,
            "grpo/stale_rollouts_dropped": self.queue.dropped,
        }
        logged = {f"grpo/{name}": sum(values) / len(values) for name, values in self._reward_logs.items()}
        self._reward_logs = {}  # (TRL's log_metric: the mean since the last log line, this rank's)
        return {**{k: float(v) for k, v in counters.items() if v}, **logged}

    def tables(self, step: int) -> dict[str, Table]:
        """Every ``log_completions`` steps: the first responses of the batch trained on, with rewards and advantages."""
        return self.completions.tables(step)

    def state_dict(self) -> dict[str, Any]:
        """The prompt position before the oldest rollout batch still in flight (or the current one)."""
        self.worker.wait()  # (a started batch notes its resume point once its job runs)
        current = [self.current] if self.current is not None and self.current.steps_left > 0 else []
        in_flight = [*current, *self.queue.batches]  # (the queue's have not started serving)
        if in_flight:
            return dict(in_flight[0].resume_point)
        return {"prompts": self.prompts.state_dict(), "batches_made": self.batches_made}

    def skip_ahead(self, steps: int, step: int, microbatches_per_step: int) -> None:
        """Rollout batches in flight are dropped (their prompts go back to the stream, as on a resume), then the
        stream moves on to the first batch an uninterrupted rank would start after ``step`` steps, with that batch's
        sampling seeds: the prompts it would have trained on meanwhile are skipped, none is repeated. (The engine
        gets the healed weights through the policy's ``on_update``.)"""
        self.load_state_dict(self.state_dict())
        started = -(-step // (self.cfg.ppo_epochs * self.cfg.minibatches))  # (batches begun by then, each whole)
        behind = max(0, started - self.batches_made)
        prompts = behind * self._prompts_per_batch(microbatches_per_step)
        self._next_prompts(prompts)
        self.batches_made += behind
        if behind:
            logger.info("skipped %d prompts (%d rollout batches) of this rank's shard to catch up", prompts, behind)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.worker.wait()  # (a batch in flight is made again from the restored position)
        self.prompts.load_state_dict(state["prompts"])
        self.batches_made = state["batches_made"]
        self._prompt_stream, self.current = None, None
        self.queue.clear()
