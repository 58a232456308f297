"""The rollout source every RL objective draws from: prompts -> the rollout engine -> scored rollouts -> rows to train
on, served for ``epochs x minibatches`` optimizer steps each.

It owns what GRPO, PPO and online DPO share: the prompt stream and its position, the chat template and stop ids, the
engine (built here, synced with the policy's weights once they are in place and after every optimizer step through
the policy handle's ``on_update``), the sampling seeds, the policy lag (the next batch generated on a thread while
the current one trains), DAPO's dynamic sampling, the rewards (rule functions, and reward models held whole or
sharded under the training plan), the frozen reference, the completions log, the timing of each part, and what a
checkpoint keeps. An objective says how it draws (``Draw``: responses per prompt, passes, whether it needs a
reference) and turns each batch, at its first use, into its rows (``MakeRows``: advantages, old log-probs, values).

The rows keep generation's layout (``titanium.rl.rollout``): under context parallelism every rank of a data-parallel
rank makes the same rows (same prompts, seed and synced weights; ``check_peers_agree`` checks it) and the models run
on each rank's part of every row (``split_ready``); with ``pad_to`` longest each microbatch keeps only the columns
its rows use (``narrow``), the very columns its log-prob forwards used.

Checkpoints: the batch being served is saved with how far it was served, so a resumed run trains on the very rows
the interrupted one would have; batches started ahead of it (policy lag) are not saved: a resumed run makes them
again from the same prompts with the same sampling seeds, with the policy as saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from titanium.batch import Batch, Fields, Metrics, Placement
from titanium.config.errors import ConfigError
from titanium.config.sections import ChatSection, DataSection, EnvironmentSection, RLSection, RolloutSection
from titanium.data.chat import build_chat_template
from titanium.data.kinds import first_columns
from titanium.data.packing import row_width
from titanium.data.prompts import PromptDataset, PromptSample
from titanium.data.tokenizer import Tokenizer
from titanium.generation.background import GenerationWorker
from titanium.generation.engine import SyncStats, build_engine, check_engine
from titanium.generation.sampling import SamplingParams
from titanium.metrics.table import Table
from titanium.model_builder import ModelSource
from titanium.rl.buffer import PendingBatch, RolloutBatch, RolloutQueue
from titanium.rl.completions import CompletionsLog
from titanium.rl.dynamic import DYNAMIC_METRICS, SampledBatch, sample_batch
from titanium.rl.env.registry import environment_spec
from titanium.rl.episodes import STATS, EpisodeRunner, check_environment
from titanium.rl.rewards.functions import (
    Rewards,
    RewardSet,
    TrainerState,
    check_rewards,
    exact_match,
    names_reward_model,
    reward_labels,
)
from titanium.rl.rewards.scores import placed_chunks, reward_model_scores, scalar_head_source, score_positions
from titanium.rl.rollout import (
    Rollout,
    batch_logprobs,
    check_peers_agree,
    from_last_stage,
    image_inputs,
    narrow,
    prompt_image_rows,
    split_ready,
    to_rollout,
)

logger = logging.getLogger(__name__)

Rows = dict[str, torch.Tensor]

GENERATION_TENSORS = ("tokens", "logprobs", "lengths", "finished")
NO_BATCH = b"\x00"
"""The checkpointed ``in_flight`` value when no batch is being served (an empty bytes object does not load with
``weights_only``; a served batch's bytes are a torch.save archive, never this)."""
TIME_PARTS = ("generate", "wait", "reward_model", "old_logprobs", "reference", "sync", "train")
"""The step-time breakdown, in seconds per rank (``<name>/time/<part>``, means over ranks): generation (its own
seconds, on the generation thread or not), sharded reward models' scores, recomputed old log-probs and reference
log-probs of the batches first used at this step, the seconds the loop waited for generation since the last
prepare (all of ``generate`` when it runs in the loop's thread; 1 - wait / generate is the share of generation
hidden behind training), and the weight sync and training (forward, backward, optimizer step: from the end of
``prepare`` to the sync) of the step before it."""


def rollout_seed(seed: int, dp_rank: int, index: int) -> int:
    """The sampling seed of a rank's ``index``-th generation call (a rollout batch, or each round of one with
    dynamic sampling): reproducible, and the same again when a resumed run makes that batch anew."""
    return hash((seed, dp_rank, index)) & 0x7FFF_FFFF_FFFF_FFFF


def sharded_reward_models(
    cfg: RLSection, policy: Any, pad_id: int | None, vocab_size: int, seq_len: int
) -> dict[str, ModelSource]:
    """``--rl.rewards`` folder -> its reward model's source, for ``reward_model_layout = "sharded"`` (built under
    the training's plan; ``policy``: the policy's source or handle, whose family it must be); none otherwise."""
    if cfg.reward_model_layout != "sharded":
        return {}
    folders = [name for name in cfg.rewards if names_reward_model(name)]
    if not folders:
        raise ConfigError("--rl.reward_model_layout sharded: --rl.rewards names no reward model folder to shard")
    return {
        name: scalar_head_source(policy.spec, name, "--rl.rewards", pad_id, vocab_size, seq_len) for name in folders
    }


def frozen_sources(cfg: RLSection, start: ModelSource, vocab_size: int, seq_len: int, reference: bool):
    """The frozen models a source configured by ``cfg`` builds (``start``: the policy as it started): the reference
    if asked for, and the sharded reward models (for the dry run's memory estimate)."""
    return [*([start] if reference else []), *sharded_reward_models(cfg, start, None, vocab_size, seq_len).values()]


def image_refusals(cfg: RLSection, engine: RolloutSection, has_environment: bool) -> list[str]:
    """What a rollout source of an image-text model cannot do yet, as messages naming the flag to change."""
    problems = []
    if engine.engine != "titanium":
        problems.append(
            f"--rollout.engine {engine.engine}: only titanium's engine feeds the prompts' images to its prefill so far "
            "(vLLM 0.32 on CPU cannot serve titanium's image-text models as they train: docs/vision.md, 'GRPO with "
            "images'); set --rollout.engine titanium with an image-text model"
        )
    if cfg.dynamic_sampling:
        problems.append(
            "--rl.dynamic_sampling: its rounds' rows are joined without their prompts' images; set "
            "--rl.no_dynamic_sampling with an image-text model"
        )
    if has_environment:
        problems.append(
            "[environment]: multi-turn episodes do not carry the prompts' images into later turns; leave "
            "--environment.name and --environment.tools empty with an image-text model"
        )
    return problems


def check_source(
    job: Any,
    rl: RLSection | None = None,
    rollout: RolloutSection | None = None,
    environment: EnvironmentSection | None = None,
) -> None:
    """What the config decides of a rollout source, checked before any process starts (an objective's
    ``check_config``; ``job``: its ``JobFacts``, and the sections the objective gets, by keyword): the rewards
    resolve (functions import and have a reward function's signature, reward-model folders hold a titanium family's
    config.json), the ``[environment]`` of multi-turn episodes and its tools load, and the ``[rollout]`` engine can
    serve this policy in this job."""
    cfg, engine = rl or RLSection(), rollout or RolloutSection()
    check_rewards(cfg.rewards, ("overlong",), cfg.reward_model_tokenizer)
    if environment is not None:
        check_environment(environment)
    start, max_model_len = job.start, cfg.max_prompt_len + cfg.max_new_tokens
    if getattr(start.args, "reads_images", False):
        on = environment is not None and environment_spec(environment) is not None
        for problem in image_refusals(cfg, engine, on):
            raise ConfigError(problem)
    check_engine(
        engine,
        start.spec,
        start.args,
        max_model_len=max_model_len,
        world_size=job.world_size,
        device_type=job.device_type,
    )


class SourceContext(Protocol):
    """What the source reads of the objective's context (``titanium.objectives.base.ObjectiveContext``)."""

    tokenizer: Tokenizer
    model_name: str
    chat_format: str
    vocab_size: int
    seq_len: int
    local_batch_size: int
    dp_rank: int
    dp_world: int
    seed: int
    models: Any
    device: torch.device
    placement: Placement
    chat: ChatSection
    fixed_shapes: bool
    sequence_multiple: int
    ranks_per_row: int
    total_steps: int
    processor: Any


@dataclass(frozen=True)
class Draw:
    """How an objective draws from the source (its own section says)."""

    name: str
    """The objective's name: its metrics are ``<name>/...`` and its completions table ``<name>/completions``."""
    group_size: int = 1
    """Responses per prompt, contiguous rows (GRPO's group, online DPO's pair, PPO's one)."""
    epochs: int = 1
    """Passes over each rollout batch."""
    minibatches: int = 1
    """Optimizer steps per pass: each rank generates this many steps' worth of responses in one go."""
    reference: bool = False
    """Hold a frozen reference (the policy as it started) for ``reference_logprobs``."""
    row_metrics: tuple[str, ...] = ()
    """Per-response metrics the objective's rows add (means over the step's responses), before the source's own."""


@dataclass
class Scored:
    """A rollout batch at its first use: its prompts, their rollout with every reward (sharded reward models' scores
    included), the base rows on the device and the policy version that generated it."""

    samples: list[PromptSample]
    rollout: Rollout
    rows: Rows
    """The model inputs (``split_ready`` under context parallelism), ``response_mask`` and the source's per-response
    metric columns; the objective adds its own."""
    version: int


MakeRows = Callable[[Scored], Metrics]
"""What an objective makes of a batch at its first use: its columns added to ``Scored.rows`` (advantages, old and
reference log-probs, values...), per-response metric columns included; returns metrics measured on the way."""


class RolloutSource:
    """Prompts -> engine -> scored rollouts -> rows, served step by step (see the module docstring)."""

    def __init__(
        self,
        ctx: SourceContext,
        data: DataSection,
        cfg: RLSection,
        engine: RolloutSection,
        draw: Draw,
        environment: EnvironmentSection | None = None,
    ) -> None:
        """``environment``: multi-turn episodes (``[environment]``; off by default: one response per prompt)."""
        if ctx.models is None:
            raise ValueError("an RL objective follows the live policy's weights: the loop must hand it (ctx.models)")
        self.cfg, self.draw, self.device = cfg, draw, ctx.device
        self.policy = ctx.models.policy()
        self.tokenizer, self.local_batch_size = ctx.tokenizer, ctx.local_batch_size
        self.placement, self.sequence_multiple = ctx.placement, ctx.sequence_multiple
        self.seed, self.dp_rank, self.ranks_per_row = ctx.seed, ctx.dp_rank, ctx.ranks_per_row
        pad_to, self.pad_multiple = row_width(
            cfg.pad_to, cfg.pad_multiple, ctx.fixed_shapes, ctx.sequence_multiple, "--rl.pad_to"
        )
        self.narrowed = pad_to == "longest" and not ctx.placement.split
        """Microbatches cut to the columns their rows use (rows split over context-parallel ranks keep their rollout
        batch's width, as with pad_to seq_len)."""
        template = None
        if data.kind != "text":  # plain prompts for base models have no chat format
            template = build_chat_template(ctx.chat.chat_template, ctx.tokenizer, ctx.chat_format)
        stop_ids = set(template.stop_ids) if template is not None else {ctx.tokenizer.eos_id}
        self.episodes = self._episode_runner(environment, template, ctx.tokenizer)
        if self.episodes is not None:  # (the prompts show the environment's tools)
            template = self.episodes.prompt_template
        self.layout = ctx.processor.layout if ctx.processor is not None else None
        """An image-text model's processor layout: its prompts are read with their images and its rollout rows carry
        them (``to_rollout``; None: a text model)."""
        self.prompts = PromptDataset(
            data, cfg, ctx.tokenizer, template, ctx.chat.system_prompt, ctx.dp_rank, ctx.dp_world, "rl", ctx.processor
        )
        self._prompt_stream: Iterator[PromptSample] | None = None
        pad_id = ctx.tokenizer.pad_id
        self.rewards = RewardSet.from_config(
            cfg,
            device=ctx.device,
            pad_id=pad_id,
            vocab_size=ctx.tokenizer.vocab_size,
            columns=first_columns(data)[0],  # (TRL's signature check of the reward functions, at start-up)
        )
        self.reward_labels = reward_labels(cfg.rewards)
        """Each reward's name in metrics (``<name>/reward/<label>``), as TRL names them."""
        self.total_steps = ctx.total_steps
        self._reward_logs: dict[str, list[float]] = {}  # (TRL's log_metric, until the next log line)
        sharded = sharded_reward_models(cfg, self.policy, pad_id, ctx.vocab_size, ctx.seq_len)
        self.reward_models = {name: ctx.models.frozen(source=source) for name, source in sharded.items()}
        self.reference = ctx.models.frozen() if draw.reference else None
        self.params = SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k)
        self.row_metrics = (
            *draw.row_metrics,
            *(f"{draw.name}/reward/{label}" for label in self.reward_labels.values()),
            *(f"{draw.name}/reward/{name}" for name in (self.episodes.reward_terms if self.episodes else ())),
            *(f"{draw.name}/env/{stat}" for stat in (STATS if self.episodes else ())),
            *((f"{draw.name}/accuracy",) if cfg.answer_column else ()),
            f"{draw.name}/response_len",
            f"{draw.name}/truncated",
        )
        dynamic = tuple(f"{draw.name}/{m}" for m in DYNAMIC_METRICS)
        self.metric_names = (
            *self.row_metrics,
            f"{draw.name}/policy_lag",
            f"{draw.name}/gen_tokens_per_s",
            *(dynamic if cfg.dynamic_sampling else dynamic[:1]),
            *(f"{draw.name}/time/{part}" for part in TIME_PARTS),
        )
        """The metrics ``next_step`` returns; the objective's own (of its loss, of ``MakeRows``) come on top."""
        self.queue = RolloutQueue(cfg.max_policy_lag)
        self.timeline: deque[tuple[str, int, float]] = deque(maxlen=64)
        """Recent (event, batch index or step, perf_counter) of generation and sync, to check the overlap."""
        self.current: RolloutBatch | None = None
        self.version = 0  # optimizer steps taken (each prepare is followed by one)
        self.batches_made = 0
        self._times: dict[str, float] = {}  # seconds spent since the last prepare, by TIME_PARTS
        self._prepared_at: float | None = None
        self.completions = CompletionsLog(
            f"{draw.name}/completions", cfg.log_completions, cfg.log_completions_count, ctx.tokenizer
        )
        self.engine = build_engine(
            engine,
            self.policy.spec,
            self.policy.args,
            stop_ids=stop_ids,
            pad_id=pad_id,
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
            self._add_time("train", time.perf_counter() - self._prepared_at)
            self._prepared_at = None
        self.timeline.append(("sync", step, time.perf_counter()))
        self._add_time("wait", self.worker.wait())  # (no generation under the sync)
        stats = self.engine.sync_from(self.policy.model, version=step, pp_group=self.policy.pp_group)
        self._add_time("sync", stats.seconds)
        self.version = step
        return stats

    def _episode_runner(
        self, cfg: EnvironmentSection | None, template: Any, tokenizer: Tokenizer
    ) -> EpisodeRunner | None:
        spec = environment_spec(cfg) if cfg is not None else None
        if spec is None:
            return None
        if template is None:
            raise ConfigError("[environment]: multi-turn episodes need a chat template (--data.kind chat or instruct)")
        return EpisodeRunner(spec, cfg, template, tokenizer, self.cfg.max_new_tokens, self.cfg.max_prompt_len)

    def close(self) -> None:
        self.worker.close()
        self.engine.close()
        if self.episodes is not None:
            self.episodes.close()

    # ----- serving -----

    def next_step(self, microbatches: int, make_rows: MakeRows) -> tuple[list[Rows], Metrics]:
        """This step's rows as ``microbatches`` parts (a new batch made first when the current one is used up,
        ``make_rows`` completing it), and the step's metrics: per-response means, the policy lag, the generation
        speed and what was measured making the batch first used now, and the seconds since the last step."""
        made: list[RolloutBatch] = []
        if self.current is None or self.current.steps_left == 0:
            pending = self.queue.pop_fresh(self.version) or self._start_batch(microbatches)
            self.current = self._finish_batch(pending, make_rows)
            made.append(self.current)
        current = self.current
        lag = self.version - current.version
        parts = current.next_step(microbatches)
        if self.narrowed:  # the columns the microbatch's rows use: those the log-prob forwards of its rows used
            parts = [narrow(part, part["response_mask"], self.pad_multiple) for part in parts]
        # The next batch's lag at its first use is the steps left on this one, plus one.
        if not self.queue and current.steps_left < self.cfg.max_policy_lag:
            self.queue.put(self._start_batch(microbatches))
        self.version += 1
        metrics = self._metrics(parts, lag, made)
        self._prepared_at = time.perf_counter()
        return parts, metrics

    def _metrics(self, parts: list[Rows], lag: int, made: list[RolloutBatch]) -> Metrics:
        name = self.draw.name
        responses = torch.tensor(float(sum(part["tokens"].shape[0] for part in parts)), device=self.device)
        per_reward = {f"{name}/reward/{label}" for label in self.reward_labels.values()}
        metrics = {  # (a response no reward function applies to has NaN rewards: left out of the sums)
            metric: (sum(part[metric].nansum() for part in parts), responses)
            for metric in self.row_metrics
            if metric not in per_reward
        }
        for metric in per_reward:  # (a reward function's mean where it applies: where it returned no None)
            values = [part[metric] for part in parts]
            metrics[metric] = (sum(v.nansum() for v in values), sum((~v.isnan()).sum() for v in values))
        metrics[f"{name}/policy_lag"] = (lag * responses, responses)
        if made:
            generated = torch.tensor(float(sum(b.generated_tokens for b in made)), device=self.device)
            seconds = torch.tensor(sum(b.generation_seconds for b in made), device=self.device)
            metrics[f"{name}/gen_tokens_per_s"] = (generated, seconds)
            for batch in made:
                for metric, (total, count) in batch.metrics.items():
                    if metric in metrics:
                        total, count = total + metrics[metric][0], count + metrics[metric][1]
                    metrics[metric] = (total, count)
        one = torch.ones((), device=self.device)
        for part, seconds in self._times.items():  # means over ranks
            metrics[f"{name}/time/{part}"] = (torch.tensor(seconds, device=self.device), one)
        self._times = {}
        return metrics

    # ----- generation -----

    def sample(self, samples: list[PromptSample], index: int) -> tuple[Rollout, int]:
        """``group_size`` sampled responses to each of ``samples`` from the engine, scored, for this rank's
        ``index``-th generation call, and the policy version that made them (a layout test replaces it with
        responses fixed in advance: tests/objectives/fixed_rollouts.py)."""
        group = self.draw.group_size
        seed = rollout_seed(self.seed, self.dp_rank, index)
        if self.episodes is not None:  # (multi-turn: the engine and the environment take turns)
            episodes, version = self.episodes.run(
                self.engine, [s for s in samples for _ in range(group)], self.params, seed
            )
            state = TrainerState(global_step=version, max_steps=self.total_steps)
            return self.episodes.rollout(episodes, self.rewards, state), version
        prompts = [s.prompt for s in samples for _ in range(group)]
        seen = image_inputs(prompt_image_rows(samples, group, max(map(len, prompts)), self.layout))
        out = self.engine.generate(prompts, self.params, seed=seed, **seen)  # (only the titanium engine takes images)
        generation = dataclasses.replace(
            out.generation, **{k: getattr(out.generation, k).to(self.device) for k in GENERATION_TENSORS}
        )
        trl_prompts = [s.trl_prompt for s in samples for _ in range(group)]
        state = TrainerState(global_step=out.version, max_steps=self.total_steps)
        rewards = self.rewards.with_tokens(prompts, generation.token_lists(keep_stop=True), trl_prompts, state)
        return to_rollout(samples, group, generation, rewards, self.tokenizer, self.layout), out.version

    def _prompts_per_batch(self, microbatches: int) -> int:
        """Prompts of one rollout batch (one generation round) with ``microbatches`` microbatches a step."""
        return microbatches * self.local_batch_size * self.draw.minibatches // self.draw.group_size

    def _next_prompts(self, n: int) -> list[PromptSample]:
        if self._prompt_stream is None:
            self._prompt_stream = iter(self.prompts)
        return [next(self._prompt_stream) for _ in range(n)]

    def _add_time(self, part: str, seconds: float) -> None:
        self._times[part] = self._times.get(part, 0.0) + seconds

    @contextlib.contextmanager
    def timed(self, part: str) -> Iterator[None]:
        """Add the seconds the block takes to ``part`` of the step-time breakdown (``TIME_PARTS``)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._add_time(part, time.perf_counter() - start)

    def _start_batch(self, microbatches: int) -> PendingBatch:
        """Start sampling the next rollout batch with the engine (on the generation thread, or here at once).

        Its prompts (every round's, with dynamic sampling) and sampling seeds are drawn by the generation job
        itself: jobs run one at a time in the order started, so the prompt stream is read in the same order with
        a thread or without, and the whole batch is made by the engine's weights of one version (a sync waits for
        the job). Its resume point (the prompt position before it) is noted when the job starts."""
        cfg, group = self.cfg, self.draw.group_size
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
            sampled = sample_batch(draw, group, self.tokenizer.pad_id, max_rounds, self.draw.name)
            self.timeline.append(("generated", resume_point["batches_made"], time.perf_counter()))
            return sampled, time.perf_counter() - start

        start = time.perf_counter()
        generation = self.worker.submit(generate)
        if not self.worker.background:  # (the loop waited for all of it)
            self._add_time("wait", time.perf_counter() - start)
        return PendingBatch(generation, self.engine.synced_version(), prompts * group, resume_point)

    def _finish_batch(self, pending: PendingBatch, make_rows: MakeRows) -> RolloutBatch:
        """The rows of a started batch at its first use: the base rows here (model inputs, response mask, the
        per-response metric columns; sharded reward models' scores), the objective's columns by ``make_rows``."""
        start = time.perf_counter()
        sampled, seconds = pending.generation.result()
        samples, out = sampled.samples, sampled.rollout
        if self.ranks_per_row > 1:
            check_peers_agree(out.tokens, self.dp_rank)
        if self.worker.background:
            self._add_time("wait", time.perf_counter() - start)
        self._add_time("generate", seconds)
        rows = {k: v.to(self.device) for k, v in out.model_inputs().items()}
        if self.placement.split:  # (each rank runs the models on its part of every row)
            rows = split_ready(rows, out.response_mask.shape[1], self.sequence_multiple, self.tokenizer.pad_id)
        if self.reward_models:
            out = dataclasses.replace(out, rewards=self._scored(rows, out))
        rows["response_mask"] = out.response_mask.to(self.device)
        rows.update({k: v.to(self.device, torch.float32) for k, v in self._response_metrics(samples, out).items()})
        scored = Scored(samples, out, rows, sampled.version)
        metrics = sampled.metrics(self.device, self.cfg.dynamic_sampling)
        metrics.update(make_rows(scored))
        return RolloutBatch(
            scored.rows,
            version=sampled.version,
            minibatches=self.draw.minibatches,
            epochs=self.draw.epochs,
            resume_point=pending.resume_point,
            generated_tokens=sampled.tokens_made,
            generation_seconds=seconds,
            metrics=metrics,
        )

    def _response_metrics(self, samples: list[PromptSample], out: Rollout) -> dict[str, torch.Tensor]:
        """The source's per-response metric columns: each reward function's value, exact match of the answer (with
        an answer column), the response length and whether it was cut at max_new_tokens."""
        name, labels = self.draw.name, self.reward_labels
        for metric, values in out.rewards.logged.items():  # (TRL's log_metric)
            self._reward_logs.setdefault(metric, []).extend(values)
        columns = {  # (an environment's reward terms go by their own names)
            f"{name}/reward/{labels.get(fn, fn)}": values for fn, values in out.rewards.per_function.items()
        }
        if self.cfg.answer_column:
            answers = [s.answer for s in samples for _ in range(self.draw.group_size)]
            columns[f"{name}/accuracy"] = torch.tensor(
                [exact_match(c, a, {}) for c, a in zip(out.completions, answers)]
            )
        columns[f"{name}/response_len"] = out.response_mask.sum(dim=1)
        columns[f"{name}/truncated"] = ~out.finished
        columns.update({f"{name}/env/{stat}": values for stat, values in out.stats.items()})
        return columns

    def _scored(self, rows: Rows, out: Rollout) -> Rewards:
        """``out``'s rewards completed with the sharded reward models' scores of its rows (their model inputs, split
        under CP), computed here by every rank together (``titanium.rl.rewards.scores``)."""
        with self.timed("reward_model"):
            mask = out.response_mask.to(self.device)
            chunks = placed_chunks(rows, score_positions(rows, mask), self.local_batch_size, self.placement)
            pp_group = self.policy.pp_group
            scores = {
                name: reward_model_scores(model, chunks, self.placement, pp_group, self.device)
                for name, model in self.reward_models.items()
            }
        return self.rewards.complete(out.rewards, scores)

    # ----- log-probs of the rows, for make_rows -----

    def logprobs(
        self, forward: Callable[[Rows], torch.Tensor | None], rows: Rows, temperature: float | None = None
    ) -> torch.Tensor:
        """``[B, T]`` log-probs of the responses under ``forward`` (a microbatch of rows at a time, narrowed to the
        columns its rows use with ``pad_to`` longest: the very columns its training microbatch keeps, so each of
        those holds a computed log-prob), of the distribution at ``temperature`` (default: the sampling one); under
        pipeline parallelism the last stage's, shared over the pipeline group."""
        width, mask = rows["response_mask"].shape[1], rows["response_mask"] if self.narrowed else None
        t = self.cfg.temperature if temperature is None else temperature
        out = batch_logprobs(forward, rows, width, t, self.local_batch_size, self.placement, mask, self.pad_multiple)
        return from_last_stage(out, rows["response_mask"].shape, self.policy.pp_group, self.device)

    def policy_logprobs(self, rows: Rows) -> torch.Tensor:
        """``[B, T]`` the trained policy's log-probs of the responses now (no gradients; every rank together)."""
        with self.timed("old_logprobs"):
            return self.logprobs(self.policy.forward, rows)

    def reference_logprobs(self, rows: Rows, temperature: float | None = None) -> torch.Tensor:
        """``[B, T]`` the frozen reference's log-probs of the responses (``Draw.reference``), at ``temperature``
        (default: the sampling one)."""
        assert self.reference is not None, "Draw.reference was not asked for"
        reference = self.reference

        def logits(inputs: Rows) -> torch.Tensor | None:
            core = (inputs["tokens"], Fields(), inputs["positions"], inputs["document_ids"])
            return reference(Batch(*core, images=inputs.get("images")))

        with self.timed("reference"):
            return self.logprobs(logits, rows, temperature)

    # ----- log and checkpoint -----

    def log_metrics(self) -> dict[str, float]:
        """Host-side counters, and the numbers reward functions logged with TRL's ``log_metric`` (this rank's mean
        since the last log line)."""
        name = self.draw.name
        counters = {
            "data/skipped_rows": self.prompts.bad_rows,
            f"{name}/long_prompts_skipped": self.prompts.too_long,
            f"{name}/stale_rollouts_dropped": self.queue.dropped,
        }
        logged = {f"{name}/{metric}": sum(values) / len(values) for metric, values in self._reward_logs.items()}
        self._reward_logs = {}
        return {**{k: float(v) for k, v in counters.items() if v}, **logged}

    def tables(self, step: int) -> dict[str, Table]:
        """Every ``log_completions`` steps: the first responses of the batch trained on, with the objective's
        numbers (``keep``)."""
        return self.completions.tables(step)

    def state_dict(self) -> dict[str, Any]:
        """The batch being served (its rows, as far as served; ``NO_BATCH``: none) and the prompt position after it:
        before the oldest batch started ahead of its use, or the current position."""
        self.worker.wait()  # (a started batch notes its resume point once its job runs)
        serving = self.current is not None and self.current.steps_left > 0
        position = (
            dict(self.queue.batches[0].resume_point)
            if self.queue
            else {"prompts": self.prompts.state_dict(), "batches_made": self.batches_made}
        )
        return {**position, "in_flight": self.current.to_bytes() if serving and self.current else NO_BATCH}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.worker.wait()  # (a batch started ahead is made again from the restored position)
        self.prompts.load_state_dict(state["prompts"])
        self.batches_made = state["batches_made"]
        self._prompt_stream = None
        in_flight = state.get("in_flight", NO_BATCH)  # (none in checkpoints of GRPO before the source)
        self.current = RolloutBatch.from_bytes(in_flight, self.device) if in_flight not in (NO_BATCH, b"") else None
        self.queue.clear()

    def skip_ahead(self, step: int, microbatches: int) -> None:
        """Under fault tolerance, a group that healed at ``step``: batches in flight are dropped (their prompts go
        back to the stream), then the stream moves on to the first batch an uninterrupted rank would start after
        ``step`` steps, with that batch's sampling seeds: the prompts it would have trained on meanwhile are skipped,
        none is repeated. (The engine gets the healed weights through the policy's ``on_update``.)"""
        self.worker.wait()
        serving = [self.current] if self.current is not None and self.current.steps_left > 0 else []
        in_flight = [*serving, *self.queue.batches]
        position = dict(in_flight[0].resume_point) if in_flight and in_flight[0].resume_point else self.state_dict()
        self.load_state_dict({**position, "in_flight": NO_BATCH})
        started = -(-step // (self.draw.epochs * self.draw.minibatches))  # (batches begun by then, each whole)
        behind = max(0, started - self.batches_made)
        prompts = behind * self._prompts_per_batch(microbatches)
        self._next_prompts(prompts)
        self.batches_made += behind
        if behind:
            logger.info("skipped %d prompts (%d rollout batches) of this rank's shard to catch up", prompts, behind)

    def keep(self, scored: Scored, numbers: dict[str, torch.Tensor]) -> None:
        """Show ``scored``'s responses with ``numbers`` (one value per response) in the completions table."""
        self.completions.keep(scored.samples, scored.rollout, numbers)
