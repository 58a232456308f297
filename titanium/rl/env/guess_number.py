"""A short multi-turn game (``--environment.name guess_number``): the prompt row's answer is a secret whole number;
each policy turn is a guess, answered "higher" or "lower" as a user turn, until the guess is right or the turns run
out (``--environment.max_turns``). The reward is ``exact_match`` of the last guess (the game is won); the term
``guesses`` (-0.1 per wrong guess, a weight of 1) prefers fast wins."""

from __future__ import annotations

import re

from titanium.data.chat import Message
from titanium.data.prompts import PromptSample
from titanium.rl.env.base import Environment, EnvReply, PolicyTurn, ToolRunner

_NUMBER = re.compile(r"-?\d+")


class GuessNumber(Environment):
    reward_terms = ("guesses",)

    def __init__(self, penalty: float = 0.1) -> None:
        self.penalty = penalty
        self.secret: int | None = None

    def reset(self, sample: PromptSample) -> None:
        if sample.answer is None or not _NUMBER.fullmatch(sample.answer.strip()):
            raise ValueError(f"guess_number needs a whole number as the row's answer, got {sample.answer!r}")
        self.secret = int(sample.answer)

    def step(self, turn: PolicyTurn, run_tool: ToolRunner) -> EnvReply:
        numbers = _NUMBER.findall(turn.text)
        if not numbers:
            return EnvReply([Message("user", "Answer with a number.")], rewards={"guesses": -self.penalty})
        guess = int(numbers[-1])
        if guess == self.secret:
            return EnvReply(done=True)
        hint = "higher" if self.secret is not None and guess < self.secret else "lower"
        return EnvReply([Message("user", hint)], rewards={"guesses": -self.penalty})
