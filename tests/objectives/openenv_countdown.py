"""A small OpenEnv environment (needs openenv-core): the policy must say "3", "2", "1" in turn; each right number
earns 1, a wrong one ends the episode. For tests/unit/test_env_adapters.py."""

from __future__ import annotations

from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class SayAction(Action):
    text: str


class CountObservation(Observation):
    prompt: str = ""


class Countdown(Environment[SayAction, CountObservation, State]):
    def __init__(self, start: int = 3) -> None:
        super().__init__()
        self.start, self.next = start, start
        self._state = State()

    def reset(self, seed: Any = None, episode_id: Any = None, **kwargs: Any) -> CountObservation:
        self.next = self.start
        return CountObservation(prompt=f"Count down from {self.start}.")

    def step(self, action: SayAction, timeout_s: Any = None, **kwargs: Any) -> CountObservation:
        self._state.step_count += 1
        if action.text.strip() != str(self.next):
            return CountObservation(done=True, reward=0.0)
        self.next -= 1
        return CountObservation(done=self.next == 0, reward=1.0, prompt=f"Now {self.next}.")

    @property
    def state(self) -> State:
        return self._state
