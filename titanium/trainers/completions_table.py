"""The rollouts shown by ``--grpo.log_completions``: prompt, completion, each reward, the total and the advantage."""

from __future__ import annotations

import torch

from titanium.data.prompts import PromptSample
from titanium.data.tokenizer import Tokenizer
from titanium.generation.rollout import Rollout
from titanium.metrics.table import Table


def completions_table(
    samples: list[PromptSample], rollout: Rollout, advantages: torch.Tensor, count: int, tokenizer: Tokenizer
) -> Table:
    """The first ``count`` responses of a rollout batch (``samples``: its prompts, each answered by as many
    contiguous responses as the group holds) with the rewards they got and their advantages. A prompt is shown as
    written (its text, or its last message), not as the tokens the template made of it."""
    shown = min(count, len(rollout.completions))
    group = len(rollout.completions) // len(samples)
    per_function = {name: values.tolist() for name, values in rollout.rewards.per_function.items()}
    total, advantage = rollout.rewards.total.tolist(), advantages.tolist()
    prompts = [samples[i // group].text or tokenizer.decode(samples[i // group].prompt) for i in range(shown)]
    rows = [
        (prompts[i], rollout.completions[i], *(values[i] for values in per_function.values()), total[i], advantage[i])
        for i in range(shown)
    ]
    return Table(("prompt", "completion", *per_function, "reward", "advantage"), rows, cut_from_start=("prompt",))
