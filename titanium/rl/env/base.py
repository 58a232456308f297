"""The environment protocol: an episode starts from a prompt row, the policy speaks, the environment answers.

An ``Environment`` is one episode's world, made fresh for each episode (``Class(**args)``) and ``reset`` with the
prompt row it starts from. After each policy turn (``PolicyTurn``: its text, the tool calls parsed from it) its
``step`` returns an ``EnvReply``: the messages the policy reads next (tool results as ``tool`` messages,
observations or a user's turn as ``user`` messages), whether the episode is over, and reward terms of the turn.
It never sees tokens: the episode runner (``titanium.rl.episodes``) renders its messages with the chat template
and appends them to the engine's own tokens.

Tools: the functions an environment class lists in ``tools`` (and those of ``--environment.tools``) are shown to
the policy and run, when ``step`` asks (``ToolRunner``), in a sandboxed process (``titanium.rl.tools.sandbox``).

Scoring (the rubric): the ``[rl]`` rewards score the episode's final answer (the last policy turn's text) and, in
their batched form, may read the whole episode (``completion_messages``); each term an environment declares in
``reward_terms`` is summed over its turns and added with weight 1.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from titanium.data.chat import Message
from titanium.data.prompts import PromptSample
from titanium.rl.tools.parsers import ToolCall
from titanium.rl.tools.sandbox import ToolResult

ToolRunner = Callable[[ToolCall], ToolResult]
"""Runs one tool call in the sandbox; never raises (errors and timeouts come back as results)."""


@dataclass(frozen=True)
class PolicyTurn:
    text: str
    """What the policy wrote, decoded, without its end-of-turn token."""
    content: str
    """The text without its tool calls."""
    tool_calls: list[ToolCall]
    """The calls parsed from it (``--environment.tool_parser``), malformed ones with their error."""
    index: int
    """0 for the first turn of the episode."""


@dataclass
class EnvReply:
    messages: list[Message] = field(default_factory=list)
    """What the policy reads next; none (or ``done``) ends the episode."""
    done: bool = False
    rewards: dict[str, float] = field(default_factory=dict)
    """This turn's reward terms (names from ``Environment.reward_terms``)."""
    tool_results: list[ToolResult] = field(default_factory=list)
    """The tool calls run for this turn (for the metrics)."""


class Environment(ABC):
    """One episode (see the module docstring)."""

    tools: ClassVar[Sequence[Callable[..., Any]]] = ()
    """Functions the policy may call (module-level functions, run in the tool processes)."""
    reward_terms: ClassVar[tuple[str, ...]] = ()
    """The reward terms ``step`` may return, each summed over the episode and added to its reward."""

    def reset(self, sample: PromptSample) -> list[Message] | None:
        """Start an episode from ``sample`` (its prompt, reference answer and row); messages returned (an opening
        observation) join the conversation before the policy's first turn (the prompt is rendered again)."""
        return None

    @abstractmethod
    def step(self, turn: PolicyTurn, run_tool: ToolRunner) -> EnvReply:
        """The environment's answer to the policy's ``turn``."""


def tool_messages(results: Sequence[ToolResult]) -> list[Message]:
    """Tool results as the ``tool`` messages a chat template renders (TRL's ``{"role": "tool", "name", "content"}``)."""
    return [Message("tool", r.content, {"name": r.name}) for r in results]


EnvironmentFactory = Callable[[], Environment]


@dataclass(frozen=True)
class EnvironmentSpec:
    """What ``[environment]`` builds: a factory of episodes, the tools it exposes and its reward terms."""

    factory: EnvironmentFactory
    tools: tuple[Callable[..., Any], ...]
    reward_terms: tuple[str, ...]
