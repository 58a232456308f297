"""A rollout engine whose policy is a script: each prompt (an episode's tokens so far) gets the ids ``respond``
returns for it, cut at the call's ``max_new_tokens``, with made-up log-probs. For the multi-turn tests, where the
same episodes must be played by titanium's runner and by TRL's tool loop (tests/unit/test_episodes.py,
tests/unit/test_grpo_tools_trl.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from titanium.generation.engine import RolloutEngine, Rollouts
from titanium.generation.generate import Generation
from titanium.generation.sampling import SamplingParams


def made_up_logprob(position: int, token: int) -> float:
    """A fixed log-prob for the token at ``position`` of the whole sequence (the engine's, for the tests)."""
    return -0.05 - ((position * 31 + token * 17) % 97) / 50


class ScriptedEngine(RolloutEngine):
    def __init__(self, respond: Callable[[list[int]], list[int]], stop_ids: set[int], pad_id: int) -> None:
        self.respond, self.stop_ids, self.pad_id = respond, stop_ids, pad_id
        self.version = 0
        self.calls: list[tuple[list[list[int]], list[list[int]]]] = []
        """(prompts, the ids returned for each) of every call."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> Rollouts:
        outs = [self.respond(list(p))[: params.max_new_tokens] for p in prompts]
        self.calls.append(([list(p) for p in prompts], outs))
        width = max(1, *(len(o) for o in outs))
        tokens = torch.full((len(outs), width), self.pad_id, dtype=torch.long)
        logprobs = torch.zeros(len(outs), width)
        for row, (prompt, out) in enumerate(zip(prompts, outs)):
            tokens[row, : len(out)] = torch.tensor(out, dtype=torch.long)
            logprobs[row, : len(out)] = torch.tensor([made_up_logprob(len(prompt) + i, t) for i, t in enumerate(out)])
        lengths = torch.tensor([len(o) for o in outs])
        finished = torch.tensor([bool(o) and o[-1] in self.stop_ids for o in outs])
        return Rollouts(Generation(tokens, logprobs, lengths, finished), self.version, 0.0)

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        pass

    def finish_sync(self, version: int) -> None:
        self.version = version
