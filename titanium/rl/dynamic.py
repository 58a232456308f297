"""DAPO's dynamic sampling: a rollout batch of groups that all carry a learning signal, refilled round by round.

A group whose rewards are all equal has advantage 0 for every response, whatever the reward scaling: it adds
nothing to the policy gradient but still weighs in the loss normalizer (and the KL). DAPO (Yu et al. 2025, its
"dynamic sampling"; verl's ``algorithm.filter_groups``) drops such groups and generates again until the batch is
full. Here a round generates as many prompts as the batch holds (verl's default generation batch), the groups with
a spread are kept in the order they were made, and what is left over of the last round is discarded; after
``max_rounds`` rounds a batch still short is filled up with equal-reward groups (training nothing but keeping
the batch's shape, which every data-parallel rank and microbatch relies on) and counted.

"Equal" is TRL's ``frac_reward_zero_std`` test: the group's (unbiased) standard deviation is close to 0
(``torch.isclose``, absolute tolerance 1e-8), so a group whose advantages would be ~1e-5 of noise goes too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from titanium.batch import Metrics
from titanium.data.prompts import PromptSample
from titanium.generation.generate import PROMPT_DOCUMENT
from titanium.models.common.kv_cache import PAD_DOCUMENT
from titanium.rl.rewards.functions import Rewards
from titanium.rl.rollout import Rollout

logger = logging.getLogger("titanium")

DYNAMIC_METRICS = ("zero_std_frac", "generation_rounds", "zero_std_trained")
"""``SampledBatch.metrics``' names (after ``<objective>/``): the first always, the others with dynamic sampling."""

Draw = Callable[[], tuple[list[PromptSample], Rollout, int]]
"""One generation round: its prompts, their rollout (``group_size`` responses each) and the policy version."""


def zero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[groups]`` True where a group's rewards have (close to) zero standard deviation, TRL's ``is_std_zero``."""
    std = rewards.float().view(-1, group_size).std(dim=1)
    return torch.isclose(std, torch.zeros_like(std))


def take_rows(rollout: Rollout, rows: Sequence[int]) -> Rollout:
    """The rollout of ``rows`` only, in that order."""
    index = torch.tensor(list(rows), dtype=torch.long, device=rollout.tokens.device)

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, index.to(t.device))

    rewards = Rewards(pick(rollout.rewards.total), {k: pick(v) for k, v in rollout.rewards.per_function.items()})
    return Rollout(
        tokens=pick(rollout.tokens),
        positions=pick(rollout.positions),
        document_ids=pick(rollout.document_ids),
        prompt_width=rollout.prompt_width,
        response_mask=pick(rollout.response_mask),
        finished=pick(rollout.finished),
        old_logprobs=pick(rollout.old_logprobs),
        rewards=rewards,
        completions=[rollout.completions[i] for i in rows],
        stats={k: pick(v) for k, v in rollout.stats.items()},
        transcripts=None if rollout.transcripts is None else [rollout.transcripts[i] for i in rows],
    )


def _widen(rollout: Rollout, prompt_width: int, response_width: int, pad_id: int) -> Rollout:
    """``rollout`` in a wider layout, as generation would have made it: more left padding before the prompts
    (padding token, position 0, padding document) and more steps after the responses (padding token, positions
    counting on, the prompt's document, out of the mask, log-prob 0)."""
    left, right = prompt_width - rollout.prompt_width, response_width - rollout.response_mask.shape[1]
    if left == right == 0:
        return rollout
    steps = torch.arange(1, right + 1, device=rollout.positions.device)
    positions = torch.cat([rollout.positions, rollout.positions[:, -1:] + steps], dim=1)
    documents = F.pad(F.pad(rollout.document_ids, (0, right), value=PROMPT_DOCUMENT), (left, 0), value=PAD_DOCUMENT)
    return Rollout(
        tokens=F.pad(rollout.tokens, (left, right), value=pad_id),
        positions=F.pad(positions, (left, 0), value=0),
        document_ids=documents,
        prompt_width=prompt_width,
        response_mask=F.pad(rollout.response_mask, (0, right), value=False),
        finished=rollout.finished,
        old_logprobs=F.pad(rollout.old_logprobs, (0, right), value=0.0),
        rewards=rollout.rewards,
        completions=rollout.completions,
        stats=rollout.stats,
        transcripts=rollout.transcripts,
    )


def concat_rollouts(parts: Sequence[Rollout], pad_id: int) -> Rollout:
    """One rollout of ``parts``' rows in order, widened to the widest prompt and response."""
    if len(parts) == 1:
        return parts[0]
    prompt_width = max(p.prompt_width for p in parts)
    response_width = max(p.response_mask.shape[1] for p in parts)
    wide = [_widen(p, prompt_width, response_width, pad_id) for p in parts]
    names = wide[0].rewards.per_function
    rewards = Rewards(
        torch.cat([p.rewards.total for p in wide]),
        {name: torch.cat([p.rewards.per_function[name] for p in wide]) for name in names},
    )
    return Rollout(
        tokens=torch.cat([p.tokens for p in wide]),
        positions=torch.cat([p.positions for p in wide]),
        document_ids=torch.cat([p.document_ids for p in wide]),
        prompt_width=prompt_width,
        response_mask=torch.cat([p.response_mask for p in wide]),
        finished=torch.cat([p.finished for p in wide]),
        old_logprobs=torch.cat([p.old_logprobs for p in wide]),
        rewards=rewards,
        completions=[c for p in wide for c in p.completions],
        stats={name: torch.cat([p.stats[name] for p in wide]) for name in wide[0].stats},
        transcripts=None if wide[0].transcripts is None else [t for p in wide for t in p.transcripts or ()],
    )


@dataclass
class SampledBatch:
    """A rollout batch as generated: its prompts, their rollout, the policy version, and how it was filled."""

    samples: list[PromptSample]
    rollout: Rollout
    version: int
    rounds: int
    """Generation rounds it took."""
    groups_made: int
    zero_std_made: int
    """Groups generated over all rounds, and how many of them had equal rewards."""
    zero_std_kept: int
    """Equal-reward groups in the batch: all of them without dynamic sampling; with it, the fill-up after the
    last round."""
    tokens_made: int
    """Response tokens generated over all rounds (for the generation speed)."""
    name: str = "grpo"
    """The objective whose metrics these are (``<name>/zero_std_frac``...)."""

    def metrics(self, device: torch.device, dynamic: bool) -> Metrics:
        """``<name>/zero_std_frac`` (TRL's ``frac_reward_zero_std``, over every group generated); with dynamic
        sampling also ``<name>/generation_rounds`` (per batch made) and ``<name>/zero_std_trained`` (the share of
        the batch's groups)."""

        def number(value: float) -> torch.Tensor:
            return torch.tensor(float(value), device=device)

        zero_std_frac, generation_rounds, zero_std_trained = (f"{self.name}/{m}" for m in DYNAMIC_METRICS)
        out: Metrics = {zero_std_frac: (number(self.zero_std_made), number(self.groups_made))}
        if dynamic:
            out[generation_rounds] = (number(self.rounds), number(1))
            out[zero_std_trained] = (number(self.zero_std_kept), number(len(self.samples)))
        return out


def sample_batch(draw: Draw, group_size: int, pad_id: int, max_rounds: int | None, name: str = "grpo") -> SampledBatch:
    """A rollout batch from ``draw``: its first round as it is (``max_rounds`` None: no dynamic sampling), or
    the groups with a reward spread from up to ``max_rounds`` rounds, filled up with equal-reward groups if
    they ran out (see the module docstring); its metrics named after the objective ``name``."""
    samples, rollout, version = draw()
    groups = len(samples)
    zero = zero_std_groups(rollout.rewards.total, group_size).tolist()
    tokens = int(rollout.response_mask.sum())
    if max_rounds is None:
        return SampledBatch(samples, rollout, version, 1, groups, sum(zero), sum(zero), tokens, name)
    made = groups
    kept: list[tuple[Rollout, list[PromptSample], list[int]]] = []  # per round: rollout, its kept prompts, groups
    spare: list[tuple[Rollout, PromptSample, int]] = []  # equal-reward groups, in the order made
    zero_made, have, rounds = 0, 0, 1
    while True:
        zero_made += sum(zero)
        take = [g for g, z in enumerate(zero) if not z][: groups - have]
        kept.append((rollout, [samples[g] for g in take], take))
        spare.extend((rollout, samples[g], g) for g, z in enumerate(zero) if z)
        have += len(take)
        if have == groups or rounds == max_rounds:
            break
        samples, rollout, _ = draw()
        zero = zero_std_groups(rollout.rewards.total, group_size).tolist()
        made += len(samples)
        tokens += int(rollout.response_mask.sum())
        rounds += 1
    filler = spare[: groups - have]
    if filler:
        logger.warning(
            "dynamic sampling: %d of %d groups still had equal rewards after %d generation rounds "
            "(--rl.dynamic_sampling_max_rounds); the batch is filled up with them (advantage 0)",
            len(filler),
            groups,
            rounds,
        )
    parts = [(r, s, g) for r, s, g in kept if g] + [(r, [s], [g]) for r, s, g in filler]
    rows = [take_rows(r, [g * group_size + j for g in gs for j in range(group_size)]) for r, _, gs in parts]
    out = concat_rollouts(rows, pad_id)
    kept_samples = [s for _, ss, _ in parts for s in ss]
    return SampledBatch(kept_samples, out, version, rounds, made, zero_made, len(filler), tokens, name)
