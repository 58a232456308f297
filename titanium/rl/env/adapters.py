"""Environments of other libraries as titanium environments, unchanged (optional extras).

- ``openenv:<package.module:Class>`` (``pip install openenv-core``): an OpenEnv ``Environment`` class, one instance
  per episode (made with ``--environment.args``), run in this process. ``reset()``'s observation opens the
  conversation (a user turn after the prompt row's messages); each policy turn becomes the environment's ``Action``
  (the one text field of the class ``step`` takes, filled with the turn's text); each observation is the next user
  turn (its one text field, or its fields as JSON) until ``done``; the observations' ``reward`` values are summed
  into the reward term ``openenv`` (weight 1), beside ``[rl]`` rewards of the final answer.
- ``verifiers:<environment id>``: not yet. verifiers 0.4 (its ``v1`` API) runs an agent harness that calls a chat
  completions server it records turns from; titanium would have to serve its engine behind that API with its token
  ids kept. Refused with a ConfigError that says so.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Callable
from typing import Any

from titanium.config.errors import ConfigError
from titanium.data.chat import Message
from titanium.data.prompts import PromptSample
from titanium.rl.env.base import Environment, EnvReply, PolicyTurn, ToolRunner
from titanium.rl.tools.loading import load_function

OBSERVATION_FIELDS = ("done", "reward", "metadata")
"""Fields every OpenEnv observation has, which are not what the policy reads."""


def build(kind: str, target: str, args: dict[str, Any]) -> tuple[Callable[[], Environment], tuple, tuple[str, ...]]:
    """(episode factory, tools, reward terms) of ``--environment.name kind:target``."""
    if kind == "verifiers":
        raise ConfigError(
            f"--environment.name verifiers:{target}: verifiers environments are not supported yet (verifiers 0.4 "
            "runs agent harnesses against a chat-completions server); write a titanium environment "
            "(titanium.rl.env.base.Environment) or use an OpenEnv one"
        )
    try:
        from openenv.core.env_server.interfaces import Environment as OpenEnvEnvironment
    except ImportError:
        raise ConfigError(f"--environment.name openenv:{target} needs OpenEnv: pip install openenv-core") from None
    cls = load_function(target, "--environment.name")
    if not (isinstance(cls, type) and issubclass(cls, OpenEnvEnvironment)):
        raise ConfigError(f"--environment.name openenv:{target} is not an OpenEnv Environment class")
    action, field = action_text_field(cls, target)
    try:
        cls(**args)
    except TypeError as e:
        raise ConfigError(f"--environment.args {json.dumps(args)}: {cls.__name__} does not take them ({e})") from None
    return (lambda: OpenEnvEpisode(cls(**args), action, field)), (), ("openenv",)


def action_text_field(cls: type, target: str) -> tuple[type, str]:
    """The ``Action`` class ``cls.step`` takes and its one text field."""
    action = typing.get_type_hints(cls.step).get("action")
    fields = [name for name, info in getattr(action, "model_fields", {}).items() if info.annotation is str]
    if len(fields) != 1:
        raise ConfigError(
            f"--environment.name openenv:{target}: its step takes {getattr(action, '__name__', action)!r}, which has "
            f"{len(fields)} text fields; the policy's turn fills exactly one"
        )
    return action, fields[0]


def observation_text(observation: Any) -> str:
    """What the policy reads of an OpenEnv observation: its one text field, or its own fields as JSON."""
    data = {k: v for k, v in observation.model_dump().items() if k not in OBSERVATION_FIELDS}
    texts = [v for v in data.values() if isinstance(v, str)]
    return texts[0] if len(data) == 1 and texts else json.dumps(data, default=str)


class OpenEnvEpisode(Environment):
    """One OpenEnv environment instance playing one episode."""

    reward_terms = ("openenv",)

    def __init__(self, env: Any, action: type, field: str) -> None:
        self.env, self.action, self.field = env, action, field

    def reset(self, sample: PromptSample) -> list[Message] | None:
        opening = observation_text(self.env.reset())
        return [Message("user", opening)] if opening else None

    def step(self, turn: PolicyTurn, run_tool: ToolRunner) -> EnvReply:
        observation = self.env.step(self.action(**{self.field: turn.text}))
        rewards = {"openenv": float(observation.reward or 0.0)}
        if observation.done:
            return EnvReply(done=True, rewards=rewards)
        return EnvReply([Message("user", observation_text(observation))], rewards=rewards)
