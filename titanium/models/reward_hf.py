"""A family's Hugging Face adapter, for its reward model: the ``*ForSequenceClassification`` checkpoint layout.

``transformers`` stores a sequence classifier as the causal LM's body (``model.*``, the same names and layouts)
plus ``score.weight`` ``[num_labels, hidden]`` and no ``lm_head``; ``config.json`` names the
``*ForSequenceClassification`` architecture, one label per output (``id2label``) and the ``pad_token_id`` that
locates each sequence's last token. This adapter wraps the family's own adapter for the body and maps titanium's
scalar head (``output.weight``, ``[1, dim]``) to ``score.weight``.

Starting a reward model from a causal LM (``head_in_checkpoint=False``) reads the same body from a
``*ForCausalLM`` folder: its ``lm_head`` is ignored and the head has no slot there, so it keeps its seeded
initialization, as TRL's reward models start (``AutoModelForSequenceClassification`` on a causal LM).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

import torch

from titanium.models.hf_adapter import HFAdapter, HFConfigError, RowSource

SCORE_KEY = "score.weight"
SEQUENCE_CLASSIFICATION = "ForSequenceClassification"


def num_labels(config: Mapping[str, Any]) -> int:
    """The label count of a ``config.json`` as ``transformers`` reads it: ``id2label``'s size, else
    ``num_labels``, else 2 (its default)."""
    labels = config.get("id2label")
    return len(labels) if isinstance(labels, Mapping) else int(config.get("num_labels", 2))


@dataclasses.dataclass(frozen=True)
class SequenceClassificationAdapter(HFAdapter):
    """``base`` (the family's adapter) for the body, ``score.weight`` for the head."""

    base: HFAdapter | None = None
    pad_token_id: int | None = None
    """The padding id the scores are read by (the tokenizer's), written to ``config.json``; a checkpoint that
    states another one is refused (its scores would be read at other positions)."""
    head_in_checkpoint: bool = True
    """False: the checkpoint is a causal LM (body only; its ``lm_head`` ignored), the head stays initialized."""

    @property
    def family(self) -> HFAdapter:
        assert self.base is not None, "SequenceClassificationAdapter needs its family's adapter"
        return self.base

    def reads(self, model_type: object) -> bool:
        return self.family.reads(model_type)

    # ----- names -----

    def hf_key(self, key: str) -> str:
        return SCORE_KEY if key == self.output_key else self.family.hf_key(key)

    def hf_source(self, key: str, args: Any) -> RowSource:
        return RowSource(SCORE_KEY) if key == self.output_key else self.family.hf_source(key, args)

    def our_key(self, hf_key: str) -> str | None:
        if hf_key == SCORE_KEY:
            return self.output_key
        found = self.family.our_key(hf_key)
        return None if found == self.output_key else found  # (lm_head is not ours)

    def has_hf_slot(self, key: str) -> bool:
        if key == self.output_key:
            return self.head_in_checkpoint
        return self.family.has_hf_slot(key)

    def ignored_hf_keys(self, args: Any, ours: Collection[str]) -> set[str]:
        """A causal LM's ``lm_head`` when starting from one; nothing in a sequence-classification checkpoint."""
        return set() if self.head_in_checkpoint else {self.family.hf_key(self.output_key)}

    def skips(self, hf_key: str, args: Any) -> bool:
        return self.family.skips(hf_key, args)

    def exports_in_source_layout(self) -> bool:
        return self.head_in_checkpoint  # (a causal LM's folder has no slot for the score head)

    def tied(self, args: Any) -> bool:
        return False  # (the score head is never the embedding, whatever the family's args say)

    def hf_shapes(self, shapes: Mapping[str, tuple[int, ...]], args: Any) -> dict[str, tuple[int, ...]]:
        out = self.family.hf_shapes({k: v for k, v in shapes.items() if k != self.output_key}, args)
        if self.output_key in shapes and self.head_in_checkpoint:
            out[SCORE_KEY] = tuple(shapes[self.output_key])
        return out

    # ----- tensors -----

    def to_hf(self, state_dict: Mapping[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        body = {k: v for k, v in state_dict.items() if k != self.output_key}
        out = self.family.to_hf(body, args)
        if self.output_key in state_dict:
            out[SCORE_KEY] = state_dict[self.output_key]
        return out

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        body = {k: v for k, v in hf_state_dict.items() if k != SCORE_KEY}
        out = self.family.from_hf(body, args)
        out.pop(self.output_key, None)  # (a tied family copies the embedding there)
        if SCORE_KEY in hf_state_dict:
            out[self.output_key] = hf_state_dict[SCORE_KEY]
        return out

    # ----- config.json -----

    def config_fields(self, args: Any) -> dict[str, tuple[str, Any]]:
        return self.family.config_fields(args)

    def unsupported(self, config: Mapping[str, Any]) -> list[str]:
        return self.family.unsupported(config) + self.head_problems(config)

    def head_problems(self, config: Mapping[str, Any]) -> list[str]:
        """What makes ``config`` unfit as this reward model's source (each one a message with the fix)."""
        if not self.head_in_checkpoint:
            return []
        architecture = (config.get("architectures") or ["?"])[0]
        if not str(architecture).endswith(SEQUENCE_CLASSIFICATION):
            return [
                f"architectures {config.get('architectures')} is not a sequence-classification (reward) model: it "
                "has no scalar score head; start the reward model from it as a causal LM (a fresh head) instead"
            ]
        problems = []
        if (labels := num_labels(config)) != 1:
            problems.append(f"num_labels {labels} != 1: a reward model has one scalar score per sequence")
        pad = config.get("pad_token_id")
        if pad is not None and self.pad_token_id is not None and pad != self.pad_token_id:
            problems.append(
                f"pad_token_id {pad} != the tokenizer's pad id {self.pad_token_id}: scores are read at the last "
                "token that is not padding, so both must agree; use the checkpoint's tokenizer"
            )
        return problems

    def from_hf_config(self, config: Mapping[str, Any], **overrides: Any) -> Any:
        problems = self.head_problems(config)
        if problems:
            raise HFConfigError("; ".join(problems))
        return self.family.from_hf_config(config, **overrides)

    def to_hf_config(self, args: Any) -> dict[str, Any]:
        config = self.family.to_hf_config(args)
        return reward_config(config, self.pad_token_id)


def sequence_classification_class(config: Mapping[str, Any]) -> str:
    """The ``*ForSequenceClassification`` class of a ``config.json``: the one ``transformers`` maps its ``model_type``
    to, else its causal-LM architecture's name with the suffix changed."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    mapped = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(config.get("model_type"))
    if mapped is not None:
        return mapped
    architecture = str(config["architectures"][0])
    return architecture.removesuffix("ForCausalLM").removesuffix(SEQUENCE_CLASSIFICATION) + SEQUENCE_CLASSIFICATION


def reward_config(config: Mapping[str, Any], pad_token_id: int | None) -> dict[str, Any]:
    """A causal LM's (or reward model's) ``config.json`` as a one-label sequence classifier's."""
    out = {k: v for k, v in config.items() if k != "num_labels"}
    out.update(
        architectures=[sequence_classification_class(config)],
        id2label={"0": "LABEL_0"},
        label2id={"LABEL_0": 0},
        pad_token_id=pad_token_id,
    )
    return out


def sequence_classification_adapter(
    base: HFAdapter, pad_token_id: int | None, *, head_in_checkpoint: bool = True
) -> SequenceClassificationAdapter:
    """The reward-model adapter of the family whose adapter is ``base``."""
    shared = {f.name: getattr(base, f.name) for f in dataclasses.fields(HFAdapter) if f.init}  # (the tables)
    return SequenceClassificationAdapter(
        **shared, base=base, pad_token_id=pad_token_id, head_in_checkpoint=head_in_checkpoint
    )
