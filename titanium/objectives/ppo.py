"""PPO in the loop: a policy, a frozen reference, rewards (rule functions and reward models) and a value model.

Rollouts come from ``titanium.rl.source.RolloutSource`` (``[rl]``, ``[rollout]``), one response per prompt, with
everything the source gives every RL objective: the engine synced after each optimizer step, the policy lag, reward
models held whole or sharded, the completions log and resume. At a batch's first use, without gradients: the
policy's log-probs of the responses (recomputed, so the ratio starts at exactly 1), the reference's (``kl_coef`` >
0), each response's score (its rewards' weighted total, minus ``missing_eos_penalty`` for a truncated response) and
the value model's per-token values. Then the math of ``titanium.objectives.losses.ppo``: KL-penalized per-token
rewards, GAE, advantages whitened over the whole batch of every data-parallel rank. The batch is served for
``ppo_epochs x minibatches`` optimizer steps; each microbatch's loss is the clipped policy loss plus ``vf_coef`` x
the clipped value loss, summed over response tokens (the loop divides by the step's response tokens over all ranks).

The value model is a decoder with a scalar head per position (``titanium.models.reward``), a trainable model of the
job (``ctx.models.trainable``: built by the job's builder under the policy's plan, its AdamW stepped, clipped,
skipped and checkpointed by the loop with the policy's), started from ``value_model_path``, the reward model, or a
seeded initialization. The loss runs its forward, so the loop's backward fills its gradients.

Under context parallelism the source makes the same rows on every rank of a data-parallel rank and each model runs
on its part of every row (``split_ready``); values of the response tokens each rank holds are completed over the cp
group (``whole_responses``). Under pipeline parallelism no rank holds either model whole, so the value model cannot
run inside the policy's loss (which a pipeline's last stage alone computes). It trains apart instead: in
``prepare``, each microbatch of the step runs forward and backward through the value model's own pipeline schedule
(``TrainableModel.train_step``) with the same loss rule (``vf_coef`` x its value loss over the step's response
tokens, ``ctx.step_units``), and its per-response value losses are handed to the policy's loss as constants, so the
logged loss and metrics are those of one process.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from titanium.batch import Batch, Fields, per_row, per_token
from titanium.config.sections import DataSection, EnvironmentSection, PPOSection, RLSection, RolloutSection
from titanium.generation.sampling import masked_entropy_sum
from titanium.model_builder import ModelSource
from titanium.models.reward import reward_spec
from titanium.objectives.base import LossResult, Metrics, ModelOutput, ObjectiveContext, Prepared
from titanium.objectives.losses.ppo import (
    ValueSums,
    generalized_advantages,
    kl_penalized_rewards,
    ppo_loss,
    value_sums,
    whiten,
)
from titanium.objectives.sourced import SourcedObjective
from titanium.rl.rewards.functions import names_reward_model
from titanium.rl.rewards.scores import ScoreFields, placed_chunks, scalar_head_source, score_positions
from titanium.rl.rollout import from_last_stage, local_responses, response_parts, trained_logprobs, whole_responses
from titanium.rl.source import Draw, RolloutSource, Scored, frozen_sources

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


ROW_METRICS = ("ppo/score", "ppo/reward", "ppo/kl", "ppo/logprob_mismatch")
"""Per response: its score (the rewards' total less any missing-EOS penalty), its total reward (score - kl_coef x
KL), its summed KL to the reference, and the mean |trainer - engine| log-prob gap of its tokens (the old log-probs
recomputed by the policy against the engine's own: ~1e-6 in float32 when the engine holds the policy's weights; a
skipped or stale sync shows as 0.1-1) (means over the step's responses)."""
TOKEN_METRICS = ("ppo/policy_loss", "ppo/value_loss", "ppo/clip_frac", "ppo/value_clip_frac", "ppo/approx_kl")


def value_source(
    cfg: PPOSection, rl: RLSection, policy: Any, pad_id: int | None, vocab: int | None, seq: int
) -> ModelSource:
    """Where the value model starts: ``value_model_path``, else the reward model when ``--rl.rewards`` names exactly
    one, else seeded (the policy's shape)."""
    reward_models = [name for name in rl.rewards if names_reward_model(name)]
    if cfg.value_model_path:
        return scalar_head_source(policy.spec, cfg.value_model_path, "--ppo.value_model_path", pad_id, vocab, seq)
    if len(reward_models) == 1:
        return scalar_head_source(policy.spec, reward_models[0], "--rl.rewards", pad_id, vocab, seq)
    return ModelSource(reward_spec(policy.spec, pad_token_id=pad_id), policy.args)


class PPOObjective(SourcedObjective):
    """PPO on prompts (``[data] kind = chat, instruct or text``), configured by ``[ppo]`` and the source's ``[rl]``.

    ``training.local_batch_size`` counts responses (one per prompt) per microbatch; a rollout batch holds
    ``minibatches`` steps' worth per rank. ``next_microbatch`` hands out empty batches: the rows are made in
    ``prepare``."""

    loss_spikes = False  # (the policy loss sits near 0, of either sign)

    @classmethod
    def frozen_sources(
        cls, section: PPOSection, start: ModelSource, vocab_size: int | None, seq_len: int, **more: Any
    ) -> list[ModelSource]:
        """The reference (with ``kl_coef > 0``) and sharded reward models (the value model trains:
        ``trainable_sources``)."""
        rl = more.get("rl") or RLSection()
        return frozen_sources(rl, start, vocab_size, seq_len, reference=section.kl_coef > 0)

    @classmethod
    def trainable_sources(
        cls, section: PPOSection, start: ModelSource, vocab_size: int | None, seq_len: int, **more: Any
    ) -> list[ModelSource]:
        """The value model (trained beside the policy, with its own AdamW)."""
        return [value_source(section, more.get("rl") or RLSection(), start, None, vocab_size, seq_len)]

    def __init__(
        self,
        ctx: ObjectiveContext,
        data: DataSection,
        cfg: PPOSection,
        rl: RLSection | None = None,
        rollout: RolloutSection | None = None,
        environment: EnvironmentSection | None = None,
    ) -> None:
        """``rl``, ``rollout`` and ``environment``: the rollout source's sections (defaults when not given)."""
        assert ctx.models is not None, "PPO trains a value model beside the policy: the loop must hand it ctx.models"
        self.cfg, self.rl, self.device = cfg, rl or RLSection(), ctx.device
        self.placement, self.sum_over_data, self.step_units = ctx.placement, ctx.sum_over_data, ctx.step_units
        self.local_batch_size = ctx.local_batch_size
        draw = Draw("ppo", 1, cfg.ppo_epochs, cfg.minibatches, cfg.kl_coef > 0, ROW_METRICS)
        self.source = RolloutSource(ctx, data, self.rl, rollout or RolloutSection(), draw, environment)
        source = value_source(cfg, self.rl, self.source.policy, ctx.tokenizer.pad_id, ctx.vocab_size, ctx.seq_len)
        self.value = ctx.models.trainable(source, name="value", lr=cfg.value_lr, max_norm=cfg.value_max_norm)
        self.metric_names = (*self.source.metric_names, *TOKEN_METRICS, "ppo/entropy")

    # ----- rollouts -----

    def prepare(self, microbatches: list[Batch]) -> Prepared:
        parts, metrics = self.source.next_step(len(microbatches), self._rows)
        batches = [
            self.placement.place(
                Batch(
                    part["tokens"],
                    PPOFields(
                        *(part[k] for k in ("old_logprobs", "old_values", "advantages", "returns", "response_mask")),
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

    def _rows(self, scored: Scored) -> Metrics:
        """A batch's PPO columns at its first use: old log-probs and values, advantages and returns, and the
        per-response score, reward, KL and engine gap."""
        cfg, rows, out = self.cfg, scored.rows, scored.rollout
        mask = rows["response_mask"]
        logprobs = self.source.policy_logprobs(rows)
        ref_logprobs = self.source.reference_logprobs(rows) if self.source.reference is not None else None
        finished = out.finished.to(self.device)
        total = out.rewards.total.to(self.device, torch.float32).nan_to_num(0.0)  # (no reward applies: 0, as nansum)
        scores = total - cfg.missing_eos_penalty * (~finished).float()
        values = self._values(rows)
        rewards, kl = kl_penalized_rewards(scores, logprobs * mask, ref_logprobs, mask, cfg.kl_coef)
        advantages, returns = generalized_advantages(rewards, values, mask, cfg.gamma, cfg.lam)
        self.source.keep(scored, {"score": scores, "reward": rewards.sum(dim=1)})
        gap = (logprobs - out.old_logprobs.to(self.device)).abs() * mask
        rows.update(
            {
                "old_logprobs": logprobs * mask,
                "old_values": values * mask,
                "advantages": whiten(advantages, mask, self.sum_over_data),
                "returns": returns * mask,
                "ppo/score": scores,
                "ppo/reward": rewards.sum(dim=1),
                "ppo/kl": kl.sum(dim=1),
                "ppo/logprob_mismatch": gap.sum(dim=1) / mask.sum(dim=1).clamp(min=1),
            }
        )
        return {}

    @torch.no_grad()
    def _values(self, rows: Rows) -> torch.Tensor:
        """``[B, T]`` the value model's values of the response positions (under pipeline parallelism the last
        stage's, shared)."""
        mask, n = rows["response_mask"], len(rows["tokens"])
        chunks = placed_chunks(rows, score_positions(rows, mask), self.local_batch_size, self.placement)
        width = mask.shape[1]
        values = [
            self._values_of(out, batch, width)
            for batch in chunks
            if (out := self.value.forward(batch.model_inputs())) is not None
        ]
        return from_last_stage(torch.cat(values) if values else None, (n, width), self.value.pp_group, self.device)

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

    def _train_value_apart(self, batches: list[Batch[PPOFields]]) -> list[Batch[PPOFields]]:
        """Under pipeline parallelism: the value model's forward and backward of the step's microbatches through its
        own schedule (its loss divided by the step's response tokens as the loop divides the policy's), and each
        microbatch with its responses' value losses as constants for the policy's loss."""
        divisor = self.step_units(batches).clamp(min=1).float()
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

    # ----- the loss -----

    def loss(self, output: ModelOutput, batch: Batch[PPOFields]) -> LossResult:
        assert output.logits is not None
        fields, cfg, temperature = batch.fields, self.cfg, self.rl.temperature
        mask = fields.loss_mask
        logits, logprobs, slots = trained_logprobs(
            output.logits, batch.tokens, mask.shape[1], response_parts(fields), self.placement, temperature
        )
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
            entropy = self.placement.add_parts(masked_entropy_sum(logits, local_mask, temperature))
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
