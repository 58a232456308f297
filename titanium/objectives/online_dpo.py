"""Online DPO (TRL's OnlineDPOTrainer): two responses per prompt from the rollout source, ranked by their rewards,
and a DPO loss on each pair against the frozen reference.

For each prompt the source samples a pair (``--rl`` sampling, rewards, lag, engine), the pair's response with the
higher reward less ``missing_eos_penalty`` for a truncated one is the chosen one (the first of the two on a tie, as
TRL ranks them), and the loss is ``--online_dpo.loss_type`` (sigmoid or ipo as TRL, or another DPO loss on log-ratios)
of the summed log-ratios log pi - log pi_ref of the two responses, with log-probs of the untempered distribution (as
TRL's). The loss unit is a pair. Every batch is new (one optimizer step per rollout batch, as TRL's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from titanium.batch import Batch, Fields, per_row, per_token
from titanium.config.components import DPO_LOSSES
from titanium.config.loader import ConfigError
from titanium.config.sections import (
    DataSection,
    DPOSection,
    EnvironmentSection,
    OnlineDPOSection,
    RLSection,
    RolloutSection,
)
from titanium.model_builder import ModelSource
from titanium.objectives.base import JobFacts, LossResult, Metrics, ModelOutput, ObjectiveContext, Prepared
from titanium.objectives.losses.dpo import PairLoss, as_pair_loss
from titanium.objectives.sourced import SourcedObjective
from titanium.rl.rollout import response_parts, rollout_images, trained_logprobs
from titanium.rl.source import Draw, RolloutSource, Scored, frozen_sources

PAIR_METRICS = ("online_dpo/rewards/chosen", "online_dpo/rewards/rejected", "online_dpo/rewards/accuracies")
"""TRL's names: beta x the chosen and rejected responses' log-ratios, and how often the chosen one's is larger."""


def chosen_of_pairs(rewards: torch.Tensor) -> torch.Tensor:
    """``[B]`` True for the chosen response of each pair of contiguous rows: the one with the higher reward, the
    first on a tie (TRL's ``first_half >= second_half``)."""
    first = rewards.view(-1, 2)
    first_wins = first[:, 0] >= first[:, 1]
    return torch.stack([first_wins, ~first_wins], dim=1).flatten()


def pair_losses(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    chosen: torch.Tensor,
    loss: PairLoss,
    params: DPOSection,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(losses, chosen, rejected)`` ``[pairs]``: the pair loss of each pair of contiguous rows, and its chosen and
    rejected responses' summed log-ratios log pi - log pi_ref over their masked tokens (``[B, T]`` log-probs;
    ``chosen`` marks one row of each pair)."""
    ratios = ((logprobs - ref_logprobs) * mask).sum(dim=1)
    chosen_ratios, rejected_ratios = ratios[chosen], ratios[~chosen]
    losses, _ = loss(chosen_ratios, rejected_ratios, params)
    return losses, chosen_ratios, rejected_ratios


def check_pair_rows(pipeline_microbatch_size: int | None) -> None:
    """A pipeline microbatch (``pipeline_microbatch_size`` rows; None without pipeline parallelism) holds whole
    pairs."""
    if pipeline_microbatch_size is not None and pipeline_microbatch_size % 2:
        raise ConfigError(
            f"--parallelism.pipeline_parallel_microbatch_size {pipeline_microbatch_size}: a pipeline microbatch "
            "must hold whole pairs (an even number of rows)"
        )


@dataclass
class PairFields(Fields):
    """A microbatch of pairs: per response, the reference's log-probs, which tokens count and whether it is the
    pair's chosen one."""

    ref_logprobs: torch.Tensor = per_row()
    loss_mask: torch.Tensor = per_row()
    chosen: torch.Tensor = per_row()
    targets: torch.Tensor | None = per_token(default=None)
    """Under context parallelism: the next token at each position (``titanium.rl.rollout.split_ready``)."""
    slots: torch.Tensor | None = per_token(default=None)

    def units(self) -> torch.Tensor:
        return torch.tensor(self.chosen.shape[0] // 2, device=self.chosen.device)


class OnlineDPOObjective(SourcedObjective):
    """Online DPO in the loop: pairs from the rollout source in ``prepare``, the DPO loss per pair."""

    loss_unit = "pairs"

    @classmethod
    def frozen_sources(
        cls, section: OnlineDPOSection, start: ModelSource, vocab_size: int | None, seq_len: int, **more: Any
    ) -> list[ModelSource]:
        return frozen_sources(more.get("rl") or RLSection(), start, vocab_size, seq_len, reference=True)

    @classmethod
    def check_config(cls, section: OnlineDPOSection, job: JobFacts, **more: Any) -> None:
        super().check_config(section, job, **more)
        check_pair_rows(job.pipeline_microbatch_size)

    def __init__(
        self,
        ctx: ObjectiveContext,
        data: DataSection,
        cfg: OnlineDPOSection,
        rl: RLSection | None = None,
        rollout: RolloutSection | None = None,
        environment: EnvironmentSection | None = None,
    ) -> None:
        assert ctx.local_batch_size % 2 == 0, "whole pairs per microbatch (config validation)"
        self.cfg, self.device, self.placement = cfg, ctx.device, ctx.placement
        self.pair_loss = as_pair_loss(DPO_LOSSES.load(cfg.loss_type))
        assert self.pair_loss.reference, "a loss on log-ratios to the reference (config validation)"
        self.params = DPOSection(beta=cfg.beta, loss_type=cfg.loss_type)
        draw = Draw("online_dpo", 2, reference=True, row_metrics=("online_dpo/score", "online_dpo/score_margin"))
        self.source = RolloutSource(ctx, data, rl or RLSection(), rollout or RolloutSection(), draw, environment)
        self.metric_names = (*self.source.metric_names, *PAIR_METRICS, "online_dpo/kl")

    def prepare(self, microbatches: list[Batch]) -> Prepared:
        parts, metrics = self.source.next_step(len(microbatches), self._rows)
        batches = [
            self.placement.place(
                Batch(
                    part["tokens"],
                    PairFields(
                        *(part[k] for k in ("ref_logprobs", "response_mask", "chosen")),
                        part.get("targets"),
                        part.get("slots"),
                    ),
                    positions=part["positions"],
                    document_ids=part["document_ids"],
                    images=rollout_images(part),
                )
            )
            for part in parts
        ]
        return Prepared(batches, metrics)

    def _rows(self, scored: Scored) -> Metrics:
        """A batch's pairs at its first use: which response of each pair is chosen, and the reference's log-probs."""
        out, rows = scored.rollout, scored.rows
        truncated = (~out.finished.to(self.device)).float()
        total = out.rewards.total.to(self.device, torch.float32).nan_to_num(0.0)  # (no reward applies: 0, TRL's nansum)
        rewards = total - self.cfg.missing_eos_penalty * truncated
        chosen = chosen_of_pairs(rewards)
        margin = (rewards.view(-1, 2)[:, 0] - rewards.view(-1, 2)[:, 1]).abs().repeat_interleave(2)
        self.source.keep(scored, {"reward": rewards, "chosen": chosen.float()})
        rows["ref_logprobs"] = self.source.reference_logprobs(rows, temperature=1.0)
        rows.update({"chosen": chosen, "online_dpo/score": rewards, "online_dpo/score_margin": margin})
        return {}

    def loss(self, output: ModelOutput, batch: Batch[PairFields]) -> LossResult:
        assert output.logits is not None
        fields = batch.fields
        width, mask = fields.loss_mask.shape[1], fields.loss_mask
        _, logprobs, _ = trained_logprobs(output.logits, batch.tokens, width, response_parts(fields), self.placement)
        losses, chosen, rejected = pair_losses(
            logprobs, fields.ref_logprobs, mask, fields.chosen, self.pair_loss, self.params
        )
        pairs = torch.tensor(float(len(chosen)), device=losses.device)
        with torch.no_grad():
            beta = self.cfg.beta
            kl = ((logprobs - fields.ref_logprobs) * mask).sum()
            metrics = {
                "online_dpo/rewards/chosen": (beta * chosen.sum(), pairs),
                "online_dpo/rewards/rejected": (beta * rejected.sum(), pairs),
                "online_dpo/rewards/accuracies": ((chosen > rejected).float().sum(), pairs),
                "online_dpo/kl": (kl, 2 * pairs),
            }
        return LossResult(losses.sum(), metrics)

    def check_layout(self, pipeline_microbatch_size: int | None) -> None:
        check_pair_rows(pipeline_microbatch_size)
