"""Reward modelling: a scalar score per sequence, trained with the Bradley-Terry loss on preference pairs.

The trained model is the family's decoder with its language-model head swapped for a one-output ``ScoreHead``
(``policy_spec``: titanium.models.reward.reward_spec), so it starts from a sequence-classification folder, from a
causal LM's body with a fresh head (as TRL's reward models start), or from the seeded initialization, and exports
as an HF ``*ForSequenceClassification`` checkpoint (``num_labels = 1``).

Rows come from the DPO data pipeline (padded, never packed): row 2g holds pair g's chosen sequence, row 2g + 1 its
rejected one. Those rows are shifted for next-token prediction (the sequence's last token is only a label), so
each row's input gets its last label appended: the model reads the whole sequence, and the score is read at its
last non-pad token, ``transformers``' rule, so the exported model scores exactly as trained. The loss unit is a
pair (titanium/objectives/losses/reward.py).

Under context parallelism each rank holds a part of every sequence, and a sequence's last token lies in one rank's
part: each rank gives the scores of the score positions it holds (zero for the others), and the placement adds
them over the context-parallel group (differentiably), so every rank has every score whole and computes the loss
whole, as DPO completes its log-prob sums.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titanium.batch import Batch, Fields, Placement, per_row
from titanium.config.loader import ConfigError
from titanium.config.sections import DataSection, RewardSection
from titanium.data.chat import build_chat_template
from titanium.data.meter import DataMeter
from titanium.data.preference import PreferenceDataset
from titanium.data.preference_batch import PreferenceBatchLoader
from titanium.data.tokenizer import Tokenizer
from titanium.models.reward import last_non_pad_index, reward_spec
from titanium.models.spec import ModelSpec
from titanium.objectives.base import (
    IGNORE_INDEX,
    JobFacts,
    LoaderObjective,
    LossResult,
    ModelOutput,
    ObjectiveContext,
)
from titanium.objectives.losses.reward import METRICS, reward_loss


@dataclass
class RewardFields(Fields):
    """Where each row's sequence ends (its score's position) and which rows open a pair."""

    index: torch.Tensor = per_row()
    """``[rows]`` the last non-pad position of each row's whole sequence."""
    pairs_per_row: torch.Tensor = per_row()
    """``[rows]`` 1 for the chosen row of a pair (rows 2g), 0 otherwise (rejected rows, empty slots)."""

    def units(self) -> torch.Tensor:
        return self.pairs_per_row.sum()


def whole_sequences(rows: dict[str, torch.Tensor], pad_id: int) -> Batch[RewardFields]:
    """The batch of a padded PreferenceBatchLoader microbatch with each row's last label appended to its input.

    Rows are single sequences, right-padded: plain causal attention (no positions or document ids) sees each
    sequence as ``transformers`` does, the padding after it changing nothing."""
    tokens, labels = rows["input"].clone(), rows["label"]
    learned = labels != IGNORE_INDEX
    has_label = learned.any(-1)
    last = (torch.arange(labels.shape[1]) * learned).argmax(-1)  # the last labelled position of each row
    appended = labels.gather(1, last[:, None]).squeeze(1)
    at = (last + 1).clamp(max=tokens.shape[1] - 1)  # (fits: the pairs were cut to seq_len - 1 tokens)
    tokens[has_label, at[has_label]] = appended[has_label]
    fields = RewardFields(last_non_pad_index(tokens, pad_id), rows["pairs_per_row"])
    return Batch(tokens, fields)


def held_scores(scores: torch.Tensor, batch: Batch[RewardFields], placement: Placement) -> torch.Tensor:
    """``[rows]``: each row's score at its ``index``, from the per-position scores ``[rows, seq, 1]`` of this rank's
    part of the rows, completed over the ranks that split the sequences (``placement.add_parts``: the rank whose
    part holds the position gives the score, the others zero; whole sequences are their own part)."""
    scores = scores.squeeze(-1)
    positions = batch.positions  # (a context-parallel part's global positions; None: 0..seq-1)
    if positions is None:
        positions = torch.arange(scores.shape[1], device=scores.device).expand_as(scores)
    held = positions == batch.fields.index[:, None].to(positions.device)
    return placement.add_parts(torch.where(held, scores, 0.0).sum(-1))


def starts_from_causal_lm(hf_start: str | None) -> bool:
    """Whether the Hugging Face start folder holds a causal LM (its body loads, the head keeps its seeded values)
    rather than a sequence classifier."""
    if hf_start is None:
        return False
    config = Path(hf_start) / "config.json"
    try:
        architectures = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False  # (the loader reports an unreadable config.json with its fix)
    return not any(str(a).endswith("ForSequenceClassification") for a in architectures)


def check_pair_rows(pipeline_microbatch_size: int | None) -> None:
    """A pipeline microbatch (None: no pipeline parallelism) must hold whole pairs: an even number of rows."""
    if pipeline_microbatch_size is not None and pipeline_microbatch_size % 2:
        raise ConfigError(
            f"--parallelism.pipeline_parallel_microbatch_size {pipeline_microbatch_size}: the reward objective "
            "keeps each pair's two rows together; use an even number of rows"
        )


class RewardObjective(LoaderObjective):
    """A reward model on preference pairs (``[data] kind = "preference"``), configured by ``[reward]``.

    ``training.local_batch_size`` pairs per microbatch (2 x as many rows). Each pair lies in a row pair, so a
    pipeline microbatch of an even row count holds whole pairs. Under tensor parallelism the one-output head stays
    whole (``score_head_plan``); under context parallelism each score comes from the rank holding its position
    (``held_scores``)."""

    metric_names = tuple(f"reward/{name}" for name in METRICS)
    loss_unit = "pairs"

    @classmethod
    def policy_spec(cls, spec: ModelSpec, tokenizer: Tokenizer | None, hf_start: str | None) -> ModelSpec:
        pad_id = tokenizer.pad_id if tokenizer is not None else None
        return reward_spec(spec, pad_token_id=pad_id, from_causal_lm=starts_from_causal_lm(hf_start))

    @classmethod
    def check_config(cls, section: RewardSection, job: JobFacts, **more: Any) -> None:
        """Rows hold at least a prompt token, a response token and the appended last token; a pipeline microbatch
        keeps each pair's two rows together."""
        if job.seq_len < 3:
            raise ConfigError(f"--training.seq_len {job.seq_len}: a reward model needs at least 3")
        check_pair_rows(job.pipeline_microbatch_size)

    def __init__(self, ctx: ObjectiveContext, data: DataSection, reward: RewardSection) -> None:
        self.cfg, self.pad_id, self.placement = reward, ctx.tokenizer.pad_id, ctx.placement
        template = build_chat_template(ctx.chat.chat_template, ctx.tokenizer, ctx.chat_format)
        # One token short of seq_len: the appended last token must fit the row.
        self.pairs = PreferenceDataset(
            data,
            template,
            ctx.seq_len - 1,
            ctx.tokenizer.bos_id,
            ctx.chat.system_prompt,
            reward.on_long_pair,
            ctx.dp_rank,
            ctx.dp_world,
        )
        self.loader = PreferenceBatchLoader(self.pairs, ctx.local_batch_size, ctx.seq_len, self.pad_id, False)
        self.meter = DataMeter(self.pairs)

    def check_layout(self, pipeline_microbatch_size: int | None) -> None:
        check_pair_rows(pipeline_microbatch_size)

    def next_microbatch(self) -> Batch[RewardFields]:
        rows = next(self.loader)
        self.meter.add(rows)
        return whole_sequences(rows, self.pad_id)

    def loss(self, output: ModelOutput, batch: Batch[RewardFields]) -> LossResult:
        assert output.logits is not None
        scores = held_scores(output.logits.float(), batch, self.placement)
        present = batch.fields.pairs_per_row[0::2] > 0
        out = reward_loss(
            scores[0::2], scores[1::2], center_rewards_coefficient=self.cfg.center_rewards_coefficient, mask=present
        )
        return LossResult(out.loss_sum, {f"reward/{name}": (value, out.pairs) for name, value in out.metrics.items()})
