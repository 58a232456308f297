"""PPO in the loop (torchtune's recipe): a policy, a frozen reference, a reward model and a value model (critic).

Each rollout batch is sampled by the ``[rollout]`` engine (as GRPO's: its own copy of the policy, synced after every
optimizer step), one response per prompt. In ``prepare``, without gradients: the policy's log-probs of the responses
(recomputed, so the ratio starts at exactly 1), the reference's (``kl_coef`` > 0), each response's score (the reward
model's at its last token plus any rule rewards, minus ``missing_eos_penalty`` for a truncated response) and the
value model's per-token values. Then the math of ``titanium.objectives.losses.ppo``: KL-penalized per-token rewards,
GAE, advantages whitened over the whole batch of every data-parallel rank. The batch is served for ``ppo_epochs x
minibatches`` optimizer steps; each microbatch's loss is the clipped policy loss plus ``vf_coef`` x the clipped
value loss, summed over response tokens (the loop divides by the step's response tokens over all ranks).

The value model is a decoder with a scalar head per position (``titanium.models.reward``), built by the job's
builder under the policy's parallel plan (FSDP, tensor parallelism: the family's plan keeps the one-output head
whole), started from ``value_model_path``, the reward model, or a seeded initialization. The loss runs its forward,
so the loop's backward fills its gradients; the objective clips them and steps the value model's own AdamW after
every optimizer step of the policy. The reward model and the reference are frozen handles, built by the same
builder. Checkpoints hold the value model and its optimizer (``checkpoint_states``) and the rollout batch in flight.

Under context parallelism every rank of a data-parallel rank makes the same rows (as GRPO's), then runs each model
on its part of every row (``split_ready``): the policy's and the reference's log-probs and the value model's values
of the response tokens it holds are completed over the cp group (``whole_responses``), and the reward model's score
at each response's last token, which one rank alone holds, is added from every rank's part (zeros elsewhere). The
rows the loss sees are then whole on every rank ([B, T] per response token), so the PPO math runs as without it.

Under pipeline parallelism no rank holds either model whole, so the value model cannot run inside the policy's loss
(which a pipeline's last stage alone computes). It trains apart instead: in ``prepare``, each microbatch of the step
runs forward and backward through the value model's own pipeline schedule (``TrainableModel.train_step``) with the
same loss rule (``vf_coef`` x its value loss over the step's response tokens on every rank), and its per-response
value losses are handed to the policy's loss as constants, so the logged loss and metrics are those of one process.
The value model's gradients are the same (its loss does not depend on the policy); the no-grad results that only the
last stage computes (log-probs, values, scores) are shared over the pipeline group (``from_last_stage``). With context
parallelism too, each stage runs on this rank's part of every row, as the policy's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanium.batch import Batch, Fields, empty_batch, per_row, per_token
from titanium.checkpoint.states import ModelState, OptimizerState
from titanium.config.sections import DataSection, PPOSection, RolloutSection
from titanium.data.chat import build_chat_template
from titanium.data.prompts import PromptDataset, PromptSample
from titanium.generation.engine import build_engine, check_engine
from titanium.generation.generate import Generation
from titanium.generation.sampling import SamplingParams, token_logprobs
from titanium.metrics.table import Table
from titanium.model_builder import ModelSource
from titanium.models.reward import reward_spec
from titanium.objectives.base import (
    JobFacts,
    LossResult,
    Metrics,
    ModelOutput,
    Objective,
    ObjectiveContext,
    Prepared,
)
from titanium.objectives.grpo import GENERATION_TENSORS, masked_entropy_sum, rollout_seed
from titanium.objectives.losses.ppo import (
    ValueSums,
    generalized_advantages,
    kl_penalized_rewards,
    ppo_loss,
    value_sums,
    whiten,
)
from titanium.parallel.grad_norm import clip_grad_norm
from titanium.rl.buffer import RolloutBatch
from titanium.rl.completions import CompletionsLog
from titanium.rl.rewards.functions import RewardSet, check_rewards, exact_match
from titanium.rl.rewards.scores import (
    ScoreFields,
    placed_chunks,
    reward_model_scores,
    scalar_head_source,
    score_positions,
)
from titanium.rl.rollout import (
    ResponseTargets,
    batch_logprobs,
    check_peers_agree,
    from_last_stage,
    local_responses,
    split_ready,
    to_rollout,
    whole_responses,
)

logger = logging.getLogger("titanium")

Rows = dict[str, torch.Tensor]


@dataclass
class PPOFields(Fields):
    """A microbatch of rollouts' own fields, per response over its T response positions."""

    old_logprobs: torch.Tensor = per_row()
    old_values: torch.Tensor = per_row()
    advantages: torch.Tensor = per_row()
    """Whitened GAE advantages (0 outside the response)."""
    returns: torch.Tensor = per_row()
    loss_mask: torch.Tensor = per_row()
    """``[B, T]`` the generated tokens (a final stop id included)."""
    targets: torch.Tensor | None = per_token(default=None)
    """Under context parallelism: the next token at each position (``titanium.rl.rollout.split_ready``)."""
    slots: torch.Tensor | None = per_token(default=None)
    """Under context parallelism: the response slot of that next token (-1: none)."""
    value_loss: torch.Tensor | None = per_row(default=None)
    """Under pipeline parallelism (the value model trained apart): ``[B]`` each response's value loss sum."""
    value_clipped: torch.Tensor | None = per_row(default=None)
    """With ``value_loss``: ``[B]`` each response's tokens whose value the clip took."""

    def units(self) -> torch.Tensor:
        return self.loss_mask.sum()


def response_parts(fields: PPOFields | ScoreFields) -> ResponseTargets | None:
    """Where this rank's positions put their response tokens under context parallelism (None: whole rows)."""
    return None if fields.targets is None or fields.slots is None else ResponseTargets(fields.targets, fields.slots)


ROW_METRICS = ("ppo/score", "ppo/reward", "ppo/kl", "ppo/response_len", "ppo/truncated", "ppo/logprob_mismatch")
"""Per response: its score, its total reward (score - kl_coef x KL), its summed KL to the reference, its length,
whether it was cut at max_new_tokens, and the mean |trainer - engine| log-prob gap of its tokens (the old log-probs
recomputed by the policy against the engine's own: 4e-7 to 1e-6 in float32 when the engine holds the policy's
weights, initial or trained (docs/post_training.md); a skipped or stale sync shows as 0.1-1) (means over the step's
responses)."""
TOKEN_METRICS = ("ppo/policy_loss", "ppo/value_loss", "ppo/clip_frac", "ppo/value_clip_frac", "ppo/approx_kl")


def value_source(cfg: PPOSection, policy: Any, pad_id: int | None, vocab_size: int | None, seq_len: int) -> ModelSource:
    """Where the value model starts: ``value_model_path``, else the reward model, else seeded (the policy's shape)."""
    folder, key = (
        (cfg.value_model_path, "value_model_path")
        if cfg.value_model_path
        else (cfg.reward_model_path, "reward_model_path")
    )
    if folder:
        return scalar_head_source(policy.spec, folder, f"--ppo.{key}", pad_id, vocab_size, seq_len)
    return ModelSource(reward_spec(policy.spec, pad_token_id=pad_id), policy.args)


class PPOObjective(Objective):
    """PPO on prompts (``[data] kind = chat, instruct or text``), configured by ``[ppo]``.

    ``training.local_batch_size`` counts responses (one per prompt) per microbatch; a rollout batch holds
    ``minibatches`` steps' worth per rank. ``next_microbatch`` hands out empty batches: the rows are made in
    ``prepare``. A checkpoint holds the prompt position, the rollout batch in flight (its rows, as far as served)
    and the value model with its optimizer (``checkpoint_states``): a resumed run goes on as the interrupted one.
    """

    loss_spikes = False  # (the policy loss sits near 0, of either sign)

    @classmethod
    def frozen_sources(
        cls, section: PPOSection, start: ModelSource, vocab_size: int | None, seq_len: int
    ) -> list[ModelSource]:
        """The reference (with ``kl_coef > 0``) and the reward model (the value model trains: ``trainable_sources``)."""
        reference = [start] if section.kl_coef > 0 else []
        if not section.reward_model_path:
            return reference
        path = section.reward_model_path
        return [*reference, scalar_head_source(start.spec, path, "--ppo.reward_model_path", None, vocab_size, seq_len)]

    @classmethod
    def trainable_sources(
        cls, section: PPOSection, start: ModelSource, vocab_size: int | None, seq_len: int
    ) -> list[ModelSource]:
        """The value model (trained beside the policy, with its own AdamW)."""
        return [value_source(section, start, None, vocab_size, seq_len)]

    @classmethod
    def check_config(
        cls, section: PPOSection, job: JobFacts, rollout: RolloutSection | None = None, **more: Any
    ) -> None:
        """Beyond the reward and value models it builds from folders: its rule rewards resolve and the ``[rollout]``
        engine can serve this policy in this job."""
        super().check_config(section, job)
        check_rewards(section.rewards)
        max_model_len = section.max_prompt_len + section.max_new_tokens
        start, world, device = job.start, job.world_size, job.device_type
        engine = rollout or RolloutSection()
        check_engine(engine, start.spec, start.args, max_model_len=max_model_len, world_size=world, device_type=device)

    def __init__(
        self, ctx: ObjectiveContext, data: DataSection, cfg: PPOSection, rollout: RolloutSection | None = None
    ) -> None:
        """``rollout``: the ``[rollout]`` section (the engine to generate with; its defaults when not given)."""
        assert ctx.models is not None, "PPO follows the live policy: the loop must hand it (ObjectiveContext.models)"
        self.cfg, self.device, self.policy = cfg, ctx.device, ctx.models.policy()
        self.placement, self.sequence_multiple = ctx.placement, ctx.sequence_multiple
        self.tokenizer, self.local_batch_size = ctx.tokenizer, ctx.local_batch_size
        self.seed, self.dp_rank, self.ranks_per_row = ctx.seed, ctx.dp_rank, ctx.ranks_per_row
        template = (
            None if data.kind == "text" else build_chat_template(ctx.chat.chat_template, ctx.tokenizer, ctx.model_name)
        )
        stop_ids = set(template.stop_ids) if template is not None else {ctx.tokenizer.eos_id}
        self.prompts = PromptDataset(
            data, cfg, ctx.tokenizer, template, ctx.chat.system_prompt, ctx.dp_rank, ctx.dp_world, name="ppo"
        )
        self._prompt_stream: Iterator[PromptSample] | None = None
        self.rule_rewards = RewardSet(cfg.rewards, cfg.reward_weights)
        self.params = SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k)
        pad_id, vocab, seq = ctx.tokenizer.pad_id, ctx.vocab_size, ctx.seq_len
        self.reward_model = None
        if cfg.reward_model_path:
            source = scalar_head_source(
                self.policy.spec, cfg.reward_model_path, "--ppo.reward_model_path", pad_id, vocab, seq
            )
            self.reward_model = ctx.models.frozen(source=source)
        self.reference = ctx.models.frozen() if cfg.kl_coef > 0 else None
        self.value = ctx.models.trainable(value_source(cfg, self.policy, pad_id, vocab, seq))
        self.value_params = [p for p in self.value.model.parameters() if p.requires_grad]
        self.value_optimizer = torch.optim.AdamW(self.value_params, lr=cfg.value_lr, weight_decay=0.0)
        self.metric_names = (
            *ROW_METRICS,
            *(("ppo/accuracy",) if cfg.answer_column else ()),
            *TOKEN_METRICS,
            "ppo/entropy",
        )
        self.current: RolloutBatch | None = None
        self.version = 0
        self.batches_made = 0
        self.completions = CompletionsLog(
            "ppo/completions", cfg.log_completions, cfg.log_completions_count, ctx.tokenizer
        )
        self.engine = build_engine(
            rollout or RolloutSection(),
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
        self.policy.on_update(self._after_update)

    # ----- after each optimizer step: the value model's own step, and the engine's weights -----

    def _after_update(self, step: int) -> None:
        """Step the value model on the gradients the step's backward left (none at the start), then sync the engine
        with the policy's weights (every rank together)."""
        if any(p.grad is not None for p in self.value_params):
            clip_grad_norm(self.value_params, self.cfg.value_max_norm, self.value.pp_group)
            self.value_optimizer.step()
            self.value_optimizer.zero_grad(set_to_none=True)
        self.engine.sync_from(self.policy.model, version=step, pp_group=self.policy.pp_group)
        self.version = step

    def close(self) -> None:
        self.engine.close()

    # ----- rollouts -----

    def next_microbatch(self) -> Batch:
        return empty_batch()

    def prepare(self, microbatches: list[Batch]) -> Prepared:
        if self.current is None or self.current.steps_left == 0:
            self.current = self._make_batch(len(microbatches))
        parts = self.current.next_step(len(microbatches))
        responses = torch.tensor(float(sum(part["tokens"].shape[0] for part in parts)), device=self.device)
        metrics: Metrics = {
            name: (sum(part[name].sum() for part in parts), responses) for name in self.metric_names if name in parts[0]
        }
        batches = [
            self.placement.place(
                Batch(
                    part["tokens"],
                    PPOFields(
                        *(part[k] for k in ("old_logprobs", "old_values", "advantages", "returns", "mask")),
                        part.get("targets"),
                        part.get("slots"),
                    ),
                    positions=part["positions"],
                    document_ids=part["document_ids"],
                )
            )
            for part in parts
        ]
        if self.value.pipelined:
            batches = self._train_value_apart(batches)
        return Prepared(batches, metrics)

    def _train_value_apart(self, batches: list[Batch[PPOFields]]) -> list[Batch[PPOFields]]:
        """Under pipeline parallelism: the value model's forward and backward of the step's microbatches through its
        own schedule (its loss divided by the step's response tokens on every rank, as the loop divides the policy's),
        and each microbatch with its responses' value losses as constants for the policy's loss."""
        units = torch.stack([batch.fields.units() for batch in batches]).sum()
        if dist.is_initialized():  # (the loop's count: over the data- and context-parallel ranks, whose units add up;
            dist.all_reduce(units)  # the tensor- and pipeline-parallel ranks of each hold copies of them)
            units = units // (self.ranks_per_row // self.placement.parts)
        divisor = units.clamp(min=1).float()
        return [self._train_value_on(batch, divisor) for batch in batches]

    def _train_value_on(self, batch: Batch[PPOFields], divisor: torch.Tensor) -> Batch[PPOFields]:
        """One microbatch of ``_train_value_apart``: the value model's step on it, and it with its value losses."""
        rows = len(batch.tokens)
        sums = ValueSums(torch.zeros(rows, device=self.device), torch.zeros(rows, device=self.device))

        def loss(output: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
            """A pipeline microbatch's value loss (the rows ``picked``); its sums kept for the policy's loss."""
            part, clip = batch.select_rows(picked), self.cfg.value_clip
            f = part.fields
            value = value_sums(self._values_of(output, part), f.old_values, f.returns, f.loss_mask, clip)
            sums.loss[picked], sums.clipped[picked] = value.loss.detach(), value.clipped.float()
            return self.cfg.vf_coef * value.loss.sum() / divisor

        self.value.train_step(batch.model_inputs(), loss)
        group = self.value.pp_group  # (zeros on the ranks without the last stage)
        value_loss, value_clipped = (from_last_stage(t, (rows,), group, self.device) for t in (sums.loss, sums.clipped))
        return dataclasses.replace(
            batch, fields=dataclasses.replace(batch.fields, value_loss=value_loss, value_clipped=value_clipped)
        )

    def _next_prompts(self, n: int) -> list[PromptSample]:
        if self._prompt_stream is None:
            self._prompt_stream = iter(self.prompts)
        return [next(self._prompt_stream) for _ in range(n)]

    def _make_batch(self, microbatches: int) -> RolloutBatch:
        """Sample the next rollout batch and compute everything the loss needs of it, as rows on the device."""
        cfg = self.cfg
        samples = self._next_prompts(microbatches * self.local_batch_size * cfg.minibatches)
        generation = self.sample(samples)
        rewards = self.rule_rewards.with_tokens(
            [s.prompt for s in samples], generation.token_lists(keep_stop=True), [s.trl_prompt for s in samples]
        )
        rollout = to_rollout(samples, 1, generation, rewards, self.tokenizer)
        if self.ranks_per_row > 1:
            check_peers_agree(rollout.tokens, self.dp_rank)
        self.batches_made += 1
        rows: Rows = {k: v.to(self.device) for k, v in rollout.model_inputs().items()}
        mask = rollout.response_mask.to(self.device)
        width = mask.shape[1]
        rows["mask"] = mask
        if self.placement.split:  # (each rank runs the models on its part of every row)
            rows = split_ready(rows, width, self.sequence_multiple, self.tokenizer.pad_id)
        logprobs = self._logprobs(self.policy.forward, rows, width)
        ref_logprobs = self._logprobs(self._reference_logits, rows, width) if self.reference is not None else None
        finished = rollout.finished.to(self.device)
        scores = rollout.rewards.total.to(self.device, torch.float32) - cfg.missing_eos_penalty * (~finished).float()
        values, reward_scores = self._scores(rows, width)
        if reward_scores is not None:
            scores = scores + reward_scores
        rewards, kl = kl_penalized_rewards(scores, logprobs * mask, ref_logprobs, mask, cfg.kl_coef)
        advantages, returns = generalized_advantages(rewards, values, mask, cfg.gamma, cfg.lam)
        group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
        scale = self.ranks_per_row if group is not None else 1
        rows.update(
            old_logprobs=logprobs * mask,
            old_values=values * mask,
            advantages=whiten(advantages, mask, group, scale),
            returns=returns * mask,
        )
        rows["ppo/score"] = scores
        self.completions.keep(samples, rollout, {"score": scores, "reward": rewards.sum(dim=1)})
        rows["ppo/reward"] = rewards.sum(dim=1)
        rows["ppo/kl"] = kl.sum(dim=1)
        rows["ppo/response_len"] = mask.sum(dim=1).float()
        rows["ppo/truncated"] = (~finished).float()
        gap = (logprobs - rollout.old_logprobs.to(self.device)).abs() * mask
        rows["ppo/logprob_mismatch"] = gap.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        if cfg.answer_column:
            rows["ppo/accuracy"] = torch.tensor(
                [exact_match(c, s.answer, {}) for c, s in zip(rollout.completions, samples)], device=self.device
            )
        return RolloutBatch(rows, self.version, cfg.minibatches, cfg.ppo_epochs)

    def sample(self, samples: list[PromptSample]) -> Generation:
        """One response to each prompt from the engine, drawn with this batch's seed, on the device (a layout test
        replaces it with responses fixed in advance: tests/objectives/fixed_rollouts.py)."""
        seed = rollout_seed(self.seed, self.dp_rank, self.batches_made)
        out = self.engine.generate([s.prompt for s in samples], self.params, seed=seed).generation
        return dataclasses.replace(out, **{k: getattr(out, k).to(self.device) for k in GENERATION_TENSORS})

    def _reference_logits(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        assert self.reference is not None
        return self.reference(Batch(inputs["tokens"], Fields(), inputs["positions"], inputs["document_ids"]))

    def _logprobs(
        self, forward: Callable[[dict[str, torch.Tensor]], torch.Tensor | None], rows: Rows, width: int
    ) -> torch.Tensor:
        """``[B, T]`` log-probs of the responses under ``forward``, a microbatch of rows at a time (under context
        parallelism each rank's part of them, completed over the cp group; under pipeline parallelism the last
        stage's, shared over the pipeline group)."""
        t = self.cfg.temperature
        out = batch_logprobs(forward, rows, width, t, self.local_batch_size, self.placement)
        return from_last_stage(out, rows["mask"].shape, self.policy.pp_group, self.device)

    @torch.no_grad()
    def _scores(self, rows: Rows, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``([B, T], [B] or None)``: the value model's values of the response positions, and the reward model's
        score of each prompt + response (``titanium.rl.rewards.scores``). None without a reward model. Under pipeline
        parallelism the last stage computes both and shares them."""
        chunks = placed_chunks(rows, score_positions(rows, rows["mask"]), self.local_batch_size, self.placement)
        values = [
            self._values_of(out, batch, width)
            for batch in chunks
            if (out := self.value.forward(batch.model_inputs())) is not None
        ]
        n, group = len(rows["tokens"]), self.value.pp_group  # (under pipeline parallelism: the last stage's, shared)
        values_of_rows = from_last_stage(torch.cat(values) if values else None, (n, width), group, self.device)
        if self.reward_model is None:
            return values_of_rows, None
        return values_of_rows, reward_model_scores(self.reward_model, chunks, self.placement, group, self.device)

    def _values_of(
        self, out: torch.Tensor, batch: Batch[PPOFields] | Batch[ScoreFields], width: int | None = None
    ) -> torch.Tensor:
        """``[B, T]`` the value model's values of the response positions of a (placed) microbatch from its output
        ``out`` ``[B, S, 1]``: the value at t is read where token t is predicted, as the log-probs are (under context
        parallelism completed over the cp group, with their gradient). ``width``: T (default: the loss mask's)."""
        if isinstance(out, DTensor):
            out = out.full_tensor()
        width = width if width is not None else batch.fields.loss_mask.shape[1]
        local, _, slots = local_responses(out.squeeze(-1).float(), batch.tokens, width, response_parts(batch.fields))
        return whole_responses(local, slots, width, self.placement)

    # ----- the loss -----

    def loss(self, output: ModelOutput, batch: Batch[PPOFields]) -> LossResult:
        assert output.logits is not None
        fields, cfg = batch.fields, self.cfg
        mask = fields.loss_mask
        width = mask.shape[1]
        # the response tokens' logits (at i predict token i + 1): of this rank's part under context parallelism
        logits, next_tokens, slots = local_responses(output.logits, batch.tokens, width, response_parts(fields))
        if isinstance(logits, DTensor):  # vocabulary-sharded under loss parallel: the responses' rows made whole
            logits = logits.full_tensor()
        logprobs = whole_responses(token_logprobs(logits, next_tokens, cfg.temperature), slots, width, self.placement)
        if fields.value_loss is not None and fields.value_clipped is not None:  # (trained apart: pipeline)
            value = ValueSums(fields.value_loss, fields.value_clipped)
        else:
            with self.value.autocast():
                values = self._values_of(self.value.model(**batch.model_inputs()), batch)
            value = value_sums(values, fields.old_values, fields.returns, mask, cfg.value_clip)
        sums = ppo_loss(
            logprobs, fields.old_logprobs, fields.advantages, mask, value, epsilon=cfg.epsilon, vf_coef=cfg.vf_coef
        )
        with torch.no_grad():
            local_mask = mask if slots is None else mask[:, slots]
            entropy = self.placement.add_parts(masked_entropy_sum(logits, local_mask, cfg.temperature))
        tokens = sums.tokens
        metrics = {
            "ppo/policy_loss": (sums.policy, tokens),
            "ppo/value_loss": (sums.value, tokens),
            "ppo/clip_frac": (sums.clipped, tokens),
            "ppo/value_clip_frac": (sums.value_clipped, tokens),
            "ppo/approx_kl": (sums.approx_kl, tokens),
            "ppo/entropy": (entropy, tokens),
        }
        return LossResult(sums.loss, metrics)

    # ----- log and checkpoint -----

    def tables(self, step: int) -> dict[str, Table]:
        """Every ``log_completions`` steps: the first responses of the batch trained on, with their scores."""
        return self.completions.tables(step)

    def log_metrics(self) -> dict[str, float]:
        counters = {"data/skipped_rows": self.prompts.bad_rows, "ppo/long_prompts_skipped": self.prompts.too_long}
        return {k: float(v) for k, v in counters.items() if v}

    def state_dict(self) -> dict[str, Any]:
        """This rank's prompt position and the rollout batch in flight, with how far it was served (``b""``: none):
        a resumed run trains on the very rows the interrupted one would have."""
        in_flight = self.current is not None and self.current.steps_left > 0
        return {
            "prompts": self.prompts.state_dict(),
            "batches_made": self.batches_made,
            "in_flight": self.current.to_bytes() if in_flight else b"",
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.batches_made, self._prompt_stream = state["batches_made"], None
        self.current = RolloutBatch.from_bytes(state["in_flight"], self.device) if state["in_flight"] else None

    def checkpoint_states(self) -> dict[str, Any]:
        """The value model's weights and its optimizer's moments (sharded as they train; DCP reshards on load)."""
        return {
            "value_model": ModelState(self.value.model),
            "value_optimizer": OptimizerState(self.value.model, self.value_optimizer),
        }
