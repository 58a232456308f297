"""Which environment ``[environment]`` names: the registry of built-in ones, a class by import path or file, or an
adapter (``openenv:``, ``verifiers:``), made into an ``EnvironmentSpec`` with its arguments checked."""

from __future__ import annotations

import json
from typing import Any

from titanium.config.errors import ConfigError
from titanium.config.registry import Registry
from titanium.config.sections import EnvironmentSection
from titanium.rl.env import adapters
from titanium.rl.env.base import Environment, EnvironmentFactory, EnvironmentSpec
from titanium.rl.tools.loading import load_function

ENVIRONMENTS = Registry("environment", "--environment.name")
ENVIRONMENTS.register("tools", "titanium.rl.env.tool_loop:ToolLoop")
ENVIRONMENTS.register("calculator", "titanium.rl.env.calculator:Calculator")
ENVIRONMENTS.register("guess_number", "titanium.rl.env.guess_number:GuessNumber")


def environment_spec(cfg: EnvironmentSection) -> EnvironmentSpec | None:
    """The environment of ``[environment]``, or None when it is off (no name, no tools: single-turn rollouts).
    Bad names, arguments and tool files are ConfigErrors (exit code 2 before anything starts)."""
    if not cfg.name and not cfg.tools:
        return None
    try:
        args = json.loads(cfg.args)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--environment.args is not JSON ({e.msg}): {cfg.args!r}") from None
    if not isinstance(args, dict):
        raise ConfigError(f"--environment.args must be a JSON object of keyword arguments, got {cfg.args!r}")
    extra = tuple(load_function(spec) for spec in cfg.tools)
    name = cfg.name or "tools"
    kind, _, rest = name.partition(":")
    if kind in ("verifiers", "openenv"):
        factory, tools, terms = adapters.build(kind, rest, args)
        return EnvironmentSpec(factory, (*tools, *extra), terms)
    cls = _environment_class(name)
    return EnvironmentSpec(_factory(cls, args), (*cls.tools, *extra), tuple(cls.reward_terms))


def _environment_class(name: str) -> type[Environment]:
    if name.partition(":")[0].endswith(".py"):
        cls = load_function(name, "--environment.name")
    else:
        cls = ENVIRONMENTS.load(name)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"--environment.name {name!r} is not an Environment class (titanium.rl.env.base)")
    return cls


def _factory(cls: type[Environment], args: dict[str, Any]) -> EnvironmentFactory:
    try:
        cls(**args)  # (wrong arguments are the config's: say so before the first batch)
    except TypeError as e:
        raise ConfigError(f"--environment.args {json.dumps(args)}: {cls.__name__} does not take them ({e})") from None
    return lambda: cls(**args)
