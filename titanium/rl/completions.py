"""The rollouts shown by ``log_completions`` (GRPO, PPO): prompt, completion, each reward and per-response numbers."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from titanium.data.prompts import PromptSample
from titanium.data.tokenizer import Tokenizer
from titanium.metrics.table import Table
from titanium.rl.rollout import Rollout


def completions_table(
    samples: list[PromptSample],
    rollout: Rollout,
    numbers: Mapping[str, torch.Tensor],
    count: int,
    tokenizer: Tokenizer,
) -> Table:
    """The first ``count`` responses of a rollout batch (``samples``: its prompts, each answered by as many
    contiguous responses as the group holds) with each reward function's value and ``numbers``, further columns of
    one value per response (GRPO: the total reward and the advantage). A prompt is shown as written (its text, or
    its last message), not as the tokens the template made of it."""
    shown = min(count, len(rollout.completions))
    group = len(rollout.completions) // len(samples)
    columns = {**rollout.rewards.per_function, **numbers}
    values = {name: column.tolist() for name, column in columns.items()}
    values.update({name: list(column) for name, column in rollout.rewards.extra.items()})  # (TRL's log_extra)
    prompts = [samples[i // group].as_written or tokenizer.decode(samples[i // group].prompt) for i in range(shown)]
    rows = [(prompts[i], rollout.completions[i], *(v[i] for v in values.values())) for i in range(shown)]
    return Table(("prompt", "completion", *values), rows, cut_from_start=("prompt",))


class CompletionsLog:
    """An objective's ``log_completions``: keeps the batch in use (references only) and, every ``every`` steps
    (0: never), its table under ``name``."""

    def __init__(self, name: str, every: int, count: int, tokenizer: Tokenizer) -> None:
        self.name, self.every, self.count, self.tokenizer = name, every, count, tokenizer
        self._shown: tuple[list[PromptSample], Rollout, Mapping[str, torch.Tensor]] | None = None

    def keep(self, samples: list[PromptSample], rollout: Rollout, numbers: Mapping[str, torch.Tensor]) -> None:
        if self.every:
            self._shown = (samples, rollout, numbers)

    def tables(self, step: int) -> dict[str, Table]:
        if not self.every or step % self.every or self._shown is None:
            return {}
        return {self.name: completions_table(*self._shown, self.count, self.tokenizer)}
