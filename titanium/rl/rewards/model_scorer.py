"""A trained reward model as a reward function: ``--rl.rewards path/to/reward_model`` scores prompt + response.

The folder is a Hugging Face ``*ForSequenceClassification`` checkpoint with one label (what ``--training.objective
reward`` exports, or any such checkpoint of a family titanium has an adapter for). It is built by the model builder
with one process's plan (titanium's reward model: the family's decoder with a scalar head, read through the
family's adapter, ``titanium.models.reward``), so every training process holds its own unsharded copy and scores
its own responses alone: no collective, whatever the training layout or the number of generation rounds. Under
context parallelism too it scores whole sequences: the rollout source takes rewards on the whole rollouts before
their rows are split over the context-parallel ranks, so each of those ranks computes the same scores itself.
(``--rl.reward_model_layout sharded`` is the other way: a frozen model under the training plan,
titanium/rl/rewards/scores.py.)

What it reads (``--rl.reward_model_tokenizer``):

- ``policy`` (default): what the policy saw and wrote, the prompt's token ids (the job's chat template's generation
  prompt) followed by the response's ids, its stop token (the end of the assistant turn) included: the
  conversation as the chat template formats it, and as the ``reward`` objective trains on it. So the reward model
  must share the job's tokenizer (its ``pad_token_id`` is checked against the tokenizer's, its vocabulary must hold
  the tokenizer's ids).
- ``own``: the conversation re-rendered with the reward model's own tokenizer (``tokenizer.json`` and
  ``tokenizer_config.json`` in its folder) and chat template, the response's text as the assistant's turn, or a
  plain text prompt followed by the response's text, encoded without added special tokens: as TRL's GRPOTrainer
  scores with a reward model and its processing class. For a reward model of another family or vocabulary.

Sequences are right-padded and scored at their last token that is not padding, as ``transformers`` does
(``tests/unit/test_reward_model_scorer.py`` compares both ways with ``AutoModelForSequenceClassification``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from titanium.checkpoint.hf import hf_model_args, read_hf_config
from titanium.config.loader import ConfigError
from titanium.config.rl_objective_sections import scalar_head_folder
from titanium.config.sections import ModelSection
from titanium.data.chat import JinjaTemplate, Message
from titanium.data.tokenizer import HFTokenizer, Tokenizer, quietly
from titanium.errors import UserError
from titanium.model_builder import DTYPES, ModelBuilder, WeightSource, resolve_spec
from titanium.models.reward import last_non_pad_index, reward_spec, sequence_scores
from titanium.models.spec import ModelSpec, ModelUse
from titanium.models.transformers import TransformersArgs

Reader = Callable[[str | list[dict[str, Any]], str], list[int]]
"""(the prompt as TRL passes it, the response's text) -> the ids a reward model with its own tokenizer reads."""


class RewardModelScorer:
    """A batched reward function (TRL's form) that scores ``prompt_ids + completion_ids`` with a reward model, or,
    with a ``reader`` (its own tokenizer), the ids the reader makes of each prompt and response text."""

    def __init__(
        self,
        model: nn.Module,
        pad_id: int,
        batch_size: int = 32,
        name: str = "reward_model",
        reader: Reader | None = None,
    ) -> None:
        self.model, self.pad_id, self.batch_size, self.reader = model, pad_id, batch_size, reader
        self.__name__ = name

    @classmethod
    def load(
        cls,
        folder: str,
        *,
        device: torch.device,
        pad_id: int,
        vocab_size: int | None,
        max_seq_len: int,
        dtype: str = "float32",
        batch_size: int = 32,
        tokenizer: Literal["policy", "own"] = "policy",
    ) -> RewardModelScorer:
        """The reward model in ``folder`` on ``device``, in ``dtype``, evaluating, without gradients, reading the
        policy's ids (``pad_id``, ``vocab_size``: the job's tokenizer's) or, with ``tokenizer`` own, the texts
        through its own tokenizer. Errors name ``--rl.rewards``: a missing folder, config.json or (own)
        tokenizer.json, a family without an adapter, a causal LM instead of a classifier, another pad id or a
        smaller vocabulary than the tokenizer's."""
        flag = f"--rl.rewards {folder}"
        config, spec = reward_model_config(folder, tokenizer)
        reader = None
        if tokenizer == "own":
            reader, own = _own_reader(folder, flag)
            pad_id, vocab_size = config.get("pad_token_id", own.pad_id), own.vocab_size
            # (its own tokens: as long as its positions allow, not the policy's prompt and response budget)
            max_seq_len = config.get("max_position_embeddings", max_seq_len)
            if pad_id is None:
                raise ConfigError(
                    f"{flag}: neither its config.json nor its tokenizer names a pad token (scores are read at the last "
                    "token that is not padding); set pad_token_id in its config.json"
                )
        spec = reward_spec(spec, pad_token_id=pad_id)
        origin = folder if tokenizer == "own" else None
        args = hf_model_args(
            spec, folder, tokenizer_vocab=vocab_size, tokenizer_origin=origin, option=flag, max_seq_len=max_seq_len
        )
        built = ModelBuilder(device).build(spec, args, weights=WeightSource(hf_folder=folder, option=flag))
        model = built.model.to(DTYPES[dtype]).eval().requires_grad_(False)
        return cls(model, pad_id, batch_size, name=Path(folder).name, reader=reader)

    def __call__(
        self,
        completions: list[str],
        completion_ids: Sequence[Sequence[int]],
        prompt_ids: Sequence[Sequence[int]],
        prompts: Sequence[str | list[dict[str, Any]]] = (),
        **kwargs: Any,
    ) -> list[float]:
        if self.reader is not None:
            return self.score([self.reader(p, c) for p, c in zip(prompts, completions, strict=True)]).tolist()
        return self.score([list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]).tolist()

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """``[N]`` float32 scores of token sequences, ``batch_size`` at a time, each batch right-padded."""
        device = next(self.model.parameters()).device
        scores = []
        for start in range(0, len(sequences), self.batch_size):
            part = sequences[start : start + self.batch_size]
            width = max(len(s) for s in part)
            tokens = torch.full((len(part), width), self.pad_id, dtype=torch.long)
            for row, ids in enumerate(part):
                tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            tokens = tokens.to(device)
            out = self.model(tokens)
            scores.append(sequence_scores(out.float(), last_non_pad_index(tokens, self.pad_id)).cpu())
        return torch.cat(scores)


def reward_model_config(
    folder: str, tokenizer: Literal["policy", "own"] = "policy"
) -> tuple[dict[str, Any], ModelSpec]:
    """The config.json of the reward model ``folder`` names in ``--rl.rewards`` and the spec that builds it (the
    native family that reads its model_type, else the transformers backend), read without building it (also before
    any process starts: titanium.preflight): a missing folder, config.json or (own) tokenizer.json, or a model_type
    neither a family nor the backend can build as a classifier, is a ``ConfigError`` naming ``--rl.rewards``."""
    flag = f"--rl.rewards {folder}"
    if not (Path(folder) / "config.json").is_file():
        raise ConfigError(
            f"{flag}: no reward model there ({Path(folder) / 'config.json'} is missing); name a Hugging Face "
            "sequence-classification folder, e.g. the reward objective's export (checkpoint last_save_in_hf)"
        )
    config = read_hf_config(folder, flag)
    try:
        spec, _ = resolve_spec(ModelSection(), folder)
    except ConfigError as e:
        raise ConfigError(f"{flag}: {e}") from None
    if spec.refusals is not None:  # (the transformers backend: can it read and run this classifier?)
        try:
            use = ModelUse(hf_checkpoint=True, score_head=True)
            problems = quietly(lambda: spec.refusals(TransformersArgs.from_config(config), use))
        except UserError as e:
            problems = [str(e)]
        if problems:
            raise ConfigError(
                f"{flag}: model_type {config.get('model_type')!r} has no titanium family, and {problems[0]}"
            )
    for problem in scalar_head_folder("--rl.rewards", folder):
        raise ConfigError(problem)
    if tokenizer == "own" and not (Path(folder) / "tokenizer.json").is_file():
        raise ConfigError(
            f"{flag} with --rl.reward_model_tokenizer own: no tokenizer.json in {folder}; save the reward "
            "model's tokenizer there (tokenizer.save_pretrained), or read the policy's ids (own -> policy)"
        )
    return config, spec


def _own_reader(folder: str, flag: str) -> tuple[Reader, Tokenizer]:
    """What a reward model with its own tokenizer reads of a prompt and a response, and that tokenizer: the folder's
    tokenizer.json (its tokenizer_config.json beside it: special tokens, chat template; ``reward_model_config``
    checked that it is there)."""
    tokenizer = HFTokenizer(str(Path(folder) / "tokenizer.json"))
    template = JinjaTemplate(tokenizer, tokenizer.chat_template) if tokenizer.chat_template else None

    def read(prompt: str | list[dict[str, Any]], completion: str) -> list[int]:
        if isinstance(prompt, str):
            return tokenizer.encode(prompt + completion, bos=False, eos=False)
        if template is None:
            raise UserError(
                f"{flag} with --rl.reward_model_tokenizer own: its tokenizer has no chat_template to render the "
                f"conversation; add one to {Path(folder) / 'tokenizer_config.json'}, or use plain text prompts"
            )
        messages = [Message(m["role"], m["content"]) for m in prompt] + [Message("assistant", completion)]
        return template.conversation_ids(messages)

    return read, tokenizer
