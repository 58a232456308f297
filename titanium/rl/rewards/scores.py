"""A reward model under the training's parallel plan, scoring rollout rows: the reward models of an RL objective
held sharded (``--rl.reward_model_layout sharded``).

The model is a frozen model of the job's builder (FSDP / TP / PP / CP like the policy), so running it is
collective: every rank of the job scores its rows together, on the loop's thread. Each row (a left-padded prompt,
then its response; the rollout layout of ``titanium.rl.rollout``) is scored at its response's last token
(the prompt's last token for an empty response). Under context parallelism one rank holds that position and the
others add zeros; under pipeline parallelism the last stage computes the scores and shares them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from titanium.batch import Batch, Fields, Placement, per_token
from titanium.checkpoint.hf import hf_model_args
from titanium.config.loader import ConfigError
from titanium.model_builder import ModelSource, WeightSource
from titanium.model_handles import FrozenHandle
from titanium.models.reward import reward_spec
from titanium.rl.rollout import from_last_stage

Rows = dict[str, torch.Tensor]


@dataclass
class ScoreFields(Fields):
    """A chunk of rollout rows to score (values, the reward model's score), placed as the loss's rows are: where
    each row's score is read, and under context parallelism the ``targets`` and ``slots`` of ``split_ready``."""

    score_at: torch.Tensor = per_token()
    """``[B, S]`` True at the response's last token (the prompt's last token for an empty response)."""
    targets: torch.Tensor | None = per_token(default=None)
    slots: torch.Tensor | None = per_token(default=None)


def scalar_head_source(
    spec: Any, folder: str, option: str, pad_id: int | None, vocab_size: int | None, seq_len: int
) -> ModelSource:
    """A reward or value model from a Hugging Face sequence-classification ``folder`` of the policy's family
    (``option``: the config key that named it, for the errors; ``vocab_size``: the policy's, None where not known
    yet: the pre-flight check)."""
    scalar = reward_spec(spec, pad_token_id=pad_id)
    args = hf_model_args(scalar, folder, option=option, max_seq_len=seq_len)
    if vocab_size is not None and args.vocab_size != vocab_size:
        raise ConfigError(
            f"{option} {folder}: its vocabulary has {args.vocab_size} entries, the policy's {vocab_size}; it reads "
            "the policy's tokens, so it needs the same tokenizer"
        )
    return ModelSource(scalar, args, WeightSource(hf_folder=folder, option=option))


def score_positions(rows: Rows, response_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` True at each row's response's last token (rows as ``split_ready`` leaves them: the responses
    are the last ``T`` columns, T = ``response_mask``'s width)."""
    seq, width = rows["tokens"].shape[1], response_mask.shape[1]
    last = seq - width + response_mask.sum(dim=1) - 1
    score_at = torch.zeros_like(rows["tokens"], dtype=torch.bool)
    score_at[torch.arange(len(last), device=last.device), last] = True
    return score_at


def placed_chunks(rows: Rows, score_at: torch.Tensor, size: int, placement: Placement) -> list[Batch[ScoreFields]]:
    """``rows`` in chunks of ``size`` rows, placed for the models (this rank's part of every row under CP)."""
    chunks = []
    for start in range(0, len(score_at), size):
        part = {k: v[start : start + size] for k, v in rows.items()}
        fields = ScoreFields(score_at[start : start + size], part.get("targets"), part.get("slots"))
        chunks.append(placement.place(Batch(part["tokens"], fields, part["positions"], part["document_ids"])))
    return chunks


@torch.no_grad()
def reward_model_scores(
    model: FrozenHandle,
    chunks: list[Batch[ScoreFields]],
    placement: Placement,
    pp_group: Any,
    device: torch.device,
) -> torch.Tensor:
    """``[B]`` float32: the reward ``model``'s score of every row of the placed ``chunks`` (``placed_chunks``), the
    same on every rank that holds the rows. Collective over the job: call it on every rank."""
    scores = []
    for batch in chunks:
        if (out := model(batch)) is not None:  # (pipeline ranks without the last stage: none)
            here = torch.where(batch.fields.score_at, out.squeeze(-1).float(), 0.0).sum(dim=1)
            scores.append(placement.add_parts(here))
    n = sum(len(batch.tokens) for batch in chunks)
    return from_last_stage(torch.cat(scores) if scores else None, (n,), pp_group, device)
