"""Rollouts for on-policy RL: prompts -> ``group_size`` sampled responses each -> rewards -> a training batch.

The batch keeps generation's layout: each row is its prompt, left-padded to the batch's widest, then
its response, with the positions and document ids generation used. A training forward over
``model_inputs()`` therefore computes the very logits the tokens were sampled from (padding is a
document of its own; tokens after a row's end are padding, outside ``response_mask``), and
``response_logprobs`` of that forward equals ``old_logprobs`` until the policy changes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from titanium.data.prompts import PromptSample
from titanium.data.tokenizer import Tokenizer
from titanium.generation.generate import PROMPT_DOCUMENT, Generation, generate, left_pad
from titanium.generation.sampling import SamplingParams, token_logprobs
from titanium.rewards import Rewards, RewardSet


@dataclass(frozen=True)
class Rollout:
    """B = prompts x group_size responses; the responses to one prompt are contiguous rows."""

    tokens: torch.Tensor
    """``[B, P + T]`` prompt (left-padded to width P) then response (``pad_id`` after its end)."""
    positions: torch.Tensor
    """``[B, P + T]`` RoPE positions: 0 at each prompt's first token, continuing into the response."""
    document_ids: torch.Tensor
    """``[B, P + T]`` 0 on left padding, 1 on the prompt and the response."""
    prompt_width: int
    """P: where the responses start."""
    response_mask: torch.Tensor
    """``[B, T]`` True on generated tokens (a final stop id included)."""
    finished: torch.Tensor
    """``[B]`` True where the response ended with a stop id; False: truncated at max_new_tokens."""
    old_logprobs: torch.Tensor
    """``[B, T]`` log-probs of the response tokens under the policy that sampled them."""
    rewards: Rewards
    completions: list[str]
    """The decoded responses, without their stop id."""

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments of the model's forward over prompt + response."""
        return {"tokens": self.tokens, "positions": self.positions, "document_ids": self.document_ids}


def response_logprobs(logits: torch.Tensor, tokens: torch.Tensor, width: int, temperature: float) -> torch.Tensor:
    """``[B, T]`` log-probs of the last ``width`` (T) tokens of ``tokens`` ``[B, P + T]`` (the responses of a
    rollout) from the logits ``[B, P + T, V]`` of a forward over them (the logits at i predict token i + 1)."""
    return token_logprobs(logits[:, -width - 1 : -1], tokens[:, -width:], temperature)


@torch.no_grad()
def batch_logprobs(
    forward: Callable[[dict[str, torch.Tensor]], torch.Tensor | None],
    rows: Mapping[str, torch.Tensor],
    width: int,
    temperature: float,
    batch_size: int,
) -> torch.Tensor | None:
    """``[B, T]`` log-probs of the responses (the last ``width`` tokens) of a rollout batch's ``rows`` under
    ``forward`` (model inputs -> logits: a frozen reference, or the trained policy recomputing the old log-probs),
    ``batch_size`` rows per forward; None where ``forward`` gives no logits (pipeline ranks without the last
    stage)."""
    parts = []
    for start in range(0, rows["tokens"].shape[0], batch_size):  # (every forward runs: a pipeline's are collective)
        part = {k: rows[k][start : start + batch_size] for k in ("tokens", "positions", "document_ids")}
        logits = forward(part)
        if logits is not None:
            parts.append(response_logprobs(logits, part["tokens"], width, temperature))
    return torch.cat(parts) if parts else None


@torch.no_grad()
def rollout(
    model: nn.Module,
    samples: Sequence[PromptSample],
    group_size: int,
    params: SamplingParams,
    rewards: RewardSet,
    tokenizer: Tokenizer,
    stop_ids: set[int],
    *,
    generator: torch.Generator | None = None,
    all_done: Callable[[bool], bool] | None = None,
    device: torch.device | str | None = None,
    compile: bool = False,
) -> Rollout:
    """Sample ``group_size`` responses to each prompt in one batch (eval mode), decode and score them.

    Under data parallelism every rank must call this with the same number of prompts and pass an
    ``all_done`` that agrees across ranks (``all_ranks_done``): generation is a collective under FSDP.
    """
    prompts = [s.prompt for s in samples for _ in range(group_size)]
    was_training = model.training
    model.eval()
    try:
        out = generate(
            model,
            prompts,
            params,
            stop_ids,
            tokenizer.pad_id,
            generator=generator,
            all_done=all_done,
            device=device,
            compile=compile,
        )
    finally:
        model.train(was_training)
    return to_rollout(samples, group_size, out, rewards, tokenizer)


def to_rollout(
    samples: Sequence[PromptSample], group_size: int, out: Generation, rewards: RewardSet, tokenizer: Tokenizer
) -> Rollout:
    """The training batch of ``group_size`` generated responses per prompt (rows in ``rollout``'s order),
    decoded and scored."""
    prompts = [s.prompt for s in samples for _ in range(group_size)]
    completions = [tokenizer.decode(ids) for ids in out.token_lists()]
    answers = [s.answer for s in samples for _ in range(group_size)]
    rows = [s.row for s in samples for _ in range(group_size)]
    prompt_tokens, prompt_positions, prompt_documents = left_pad(prompts, tokenizer.pad_id, out.tokens.device)
    steps = torch.arange(1, out.tokens.shape[1] + 1, device=out.tokens.device)
    return Rollout(
        tokens=torch.cat([prompt_tokens, out.tokens], dim=1),
        positions=torch.cat([prompt_positions, prompt_positions[:, -1:] + steps], dim=1),
        document_ids=torch.cat([prompt_documents, torch.full_like(out.tokens, PROMPT_DOCUMENT)], dim=1),
        prompt_width=prompt_tokens.shape[1],
        response_mask=out.mask(),
        finished=out.finished,
        old_logprobs=out.logprobs,
        rewards=rewards(completions, answers, rows),
        completions=completions,
    )
