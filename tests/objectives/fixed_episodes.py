"""``python -m tests.objectives.fixed_episodes JOBS.json``: GRPO on multi-turn episodes fixed in advance.

As tests/objectives/fixed_rollouts.py does for single responses: sampling differs between layouts, so the layout
tests replace it. Episode j of a prompt (in rollout batch ``index``) is drawn from a generator seeded by the prompt's
tokens, j and ``index``: one to three policy turns of a few tokens (each ending with a stop id, the last maybe cut
by the budget instead) with environment turns of a few tokens between them. The rows are made by the episode runner
(``EpisodeRunner.rollout``: prompt, then the episode, ``response_mask`` with holes where the environment spoke), the
old log-probs are a forward of the engine's copy of the policy (what sampling returns); everything else (rewards,
advantages, the loss, the layouts) is the real objective. Jobs run with ``--environment.name
tests.objectives.fixed_episodes:Silent`` so the source holds an episode runner.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from titanium.data.prompts import PromptSample
from titanium.rl.env.base import Environment, EnvReply, PolicyTurn, ToolRunner
from titanium.rl.episodes import Episode
from titanium.rl.rollout import Rollout, response_logprobs
from titanium.rl.source import RolloutSource


class Silent(Environment):
    """Never asked: the episodes are made up by ``fixed_sample``."""

    def step(self, turn: PolicyTurn, run_tool: ToolRunner) -> EnvReply:
        return EnvReply(done=True)


def fixed_episode(sample: PromptSample, j: int, index: int, source: RolloutSource) -> Episode:
    budget, stop = source.cfg.max_new_tokens, min(source.engine.stop_ids)
    g = torch.Generator().manual_seed(hash((tuple(sample.prompt), j, index)) & 0xFFFF_FFFF)
    episode = Episode(sample, None, done=True)
    turns = int(torch.randint(1, 4, (1,), generator=g))
    for turn in range(turns):
        n = int(torch.randint(1, 6, (1,), generator=g))
        ids = torch.randint(200, 2000, (n,), generator=g).tolist()
        ids[-1] = stop
        episode.tokens += ids
        episode.policy += [True] * n
        episode.stats["turns"] += 1
        if turn < turns - 1:
            m = int(torch.randint(1, 5, (1,), generator=g))
            episode.tokens += torch.randint(200, 2000, (m,), generator=g).tolist()
            episode.policy += [False] * m
            episode.stats["env_tokens"] += m
    episode.tokens, episode.policy = episode.tokens[:budget], episode.policy[:budget]
    episode.finished = episode.tokens[-1] == stop and episode.policy[-1]
    episode.logprobs = [0.0] * len(episode.tokens)
    episode.answer = source.tokenizer.decode(episode.tokens[-3:])
    return episode


def fixed_sample(self: RolloutSource, samples: list[PromptSample], index: int) -> tuple[Rollout, int]:
    """Stands in for ``RolloutSource.sample``: episodes that depend only on the prompt, j and ``index``."""
    assert self.episodes is not None, "run the jobs with --environment.name tests.objectives.fixed_episodes:Silent"
    episodes = [fixed_episode(s, j, index, self) for s in samples for j in range(self.draw.group_size)]
    made = self.episodes.rollout(episodes, self.rewards)
    with torch.no_grad():  # (the sampler's log-probs: those of the engine's copy of the policy)
        logits = self.engine.model(**made.model_inputs())
    width = made.response_mask.shape[1]
    old = response_logprobs(logits, made.tokens, width, self.cfg.temperature) * made.response_mask
    return dataclasses.replace(made, old_logprobs=old.cpu()), self.engine.synced_version()


if __name__ == "__main__":
    from tests.distributed.jobs_worker import run_jobs_file

    RolloutSource.sample = fixed_sample
    run_jobs_file(sys.argv[1])
