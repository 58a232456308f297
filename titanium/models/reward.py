"""Reward models: the shared decoder with a scalar score head, as ``transformers``' ``*ForSequenceClassification``.

A reward model is any family's ``Decoder`` whose output projection is ``[1, dim]`` (Hugging Face's ``score``
layer, no bias) instead of ``[vocab, dim]``. The head keeps the module name ``output``, so everything built
around the decoder works unchanged: the forward returns per-position scores ``[B, S, 1]`` (float32) the way it
returns logits, a pipeline's last stage holds the head, FSDP wraps it with the final norm, and float8/QAT
filters that keep ``output`` in high precision keep the head there too. The head is never tied to the
embedding and never soft-capped (``transformers`` applies Gemma 2's ``final_logit_softcapping`` to LM logits
only, not to a sequence-classification score).

The score of a sequence is its per-position score at the last token that is not padding: for each row the
rightmost position whose token differs from ``pad_token_id`` (``transformers``' rule, which handles right and
left padding alike and, when padding uses the EOS id, skips trailing EOS tokens too). ``sequence_scores``
applies it, so a model trained on these scores exports with the same ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from titanium.models.common.decoder import Decoder
from titanium.models.reward_hf import sequence_classification_adapter
from titanium.models.spec import ModelSpec


class ScoreHead(nn.Linear):
    """The scalar head: ``hidden [.., dim] -> score [.., 1]``, no bias, no soft-capping."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim, 1, bias=False)
        self.logit_softcap = None  # (read by losses that apply the projection themselves)


def as_reward_model(model: nn.Module) -> nn.Module:
    """Turn ``model`` (any family's decoder, typically on meta) into a reward model, in place.

    The output projection becomes a ``ScoreHead``; the model's own ``DecoderArgs`` lose tied embeddings and the
    final soft-cap, which belong to the language-model head (the family's args, those ``config.json`` states,
    are not touched). ``init_weights`` then draws the head from the run seed like any output projection. A model
    of another backend (the transformers backend's) swaps its head itself (``use_score_head``).
    """
    if not isinstance(model, Decoder):
        model.use_score_head()
        return model
    model.args = dataclasses.replace(model.args, tie_word_embeddings=False, final_logit_softcap=None)
    model.output = ScoreHead(model.args.dim)
    return model


def is_reward_model(model: nn.Module) -> bool:
    """Whether ``model`` (or the last pipeline stage holding the head) ends in a scalar score head."""
    return isinstance(getattr(model, "output", None), ScoreHead)


def reward_model_cls(model_cls: Callable[[Any], nn.Module]) -> Callable[[Any], nn.Module]:
    """A ``ModelSpec.model_cls`` that builds the family's decoder and turns it into a reward model."""

    def build(args: Any) -> nn.Module:
        return as_reward_model(model_cls(args))

    return build


def reward_spec(spec: ModelSpec, *, pad_token_id: int | None, from_causal_lm: bool = False) -> ModelSpec:
    """The reward-model version of a family's spec, for the ``ModelBuilder``.

    Its HF adapter reads and writes sequence-classification checkpoints (``score.weight``, ``num_labels = 1``,
    ``pad_token_id``); with ``from_causal_lm`` it instead starts from a causal-LM checkpoint: the body loads,
    ``lm_head`` is left out and the head keeps its seeded initialization (as TRL starts a reward model). The
    family's tensor-parallel plan applies: it keeps a one-output head whole (``score_head_plan`` in
    ``titanium/models/common/parallelize.py``).
    """
    adapter = spec.hf_adapter
    if adapter is not None:
        adapter = sequence_classification_adapter(adapter, pad_token_id, head_in_checkpoint=not from_causal_lm)
    return dataclasses.replace(spec, model_cls=reward_model_cls(spec.model_cls), hf_adapter=adapter)


def last_non_pad_index(tokens: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """``[B]`` index of the rightmost token of each row of ``tokens [B, S]`` that is not ``pad_token_id``.

    ``transformers``' rule: a row of padding only gives 0; without a pad id every row is scored at its last
    position (``transformers`` then refuses batches of more than one row; titanium's rows have equal length).
    """
    batch, seq = tokens.shape
    if pad_token_id is None:
        return torch.full((batch,), seq - 1, dtype=torch.long, device=tokens.device)
    positions = torch.arange(seq, device=tokens.device)
    return (positions * (tokens != pad_token_id)).argmax(-1)


def sequence_scores(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[B]``: the per-position scores ``[B, S, 1]`` (or ``[B, S]``) of each row at ``index [B]``."""
    if scores.dim() == 3:
        scores = scores.squeeze(-1)
    return scores.gather(1, index.view(-1, 1).to(scores.device)).squeeze(1)
