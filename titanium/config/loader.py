"""Build a JobConfig from dataclass defaults < TOML file < CLI flags.

TOML values are checked against the dataclass field types here (tyro checks the CLI), so a typo in a
config file fails with the file, section and key named, before any process group exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import tyro

from titanium.config.components import OBJECTIVES, unread_sections
from titanium.config.errors import ConfigError
from titanium.config.job import job_config_class
from titanium.config.moved import (
    move_dpo_knobs,
    move_flags,
    move_toml_keys,
    prepend_reward_model,
    take_ppo_reward_model,
)
from titanium.config.registry import SectionSpec
from titanium.config.shipped import shipped
from titanium.config.trl_names import check_trl_names
from titanium.config.validate import unread_settings, validate

logger = logging.getLogger("titanium")

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


PROG = "python -m titanium.train"
"""How --help and the unknown-option message name the program: as users type it (not the path of train.py)."""
DESCRIPTION = (
    "Train or post-train a model with titanium. Every key of a TOML job config is a flag (--section.key value); "
    "dataclass defaults < --job.config_file < flags. Started from a Hugging Face folder "
    "(--checkpoint.initial_load_path X --checkpoint.initial_load_in_hf), the family, tokenizer and chat template "
    "are the folder's, and --data.kind auto reads the data's columns."
)
Resolver = Callable[[Any, frozenset[str]], None]
"""Fills in what a job's inputs say (titanium.inputs): called with the config and the keys ("section.key") the TOML
file or the command line set, before validation."""


def load_config(argv: list[str], resolve: Resolver | None = None) -> Any:
    """Parse `argv` (without the program name) into a validated job config (titanium.config.JobConfig, plus the
    section of an objective given by import path); ``resolve`` completes it from its inputs before validation."""
    argv, reward_model = take_ppo_reward_model(move_flags(argv))
    check_trl_names(argv)
    config_file = _flag(argv, "--job.config_file")
    config_file = shipped(config_file) if config_file is not None else None
    data = move_toml_keys(_read_toml(config_file), config_file) if config_file is not None else {}
    data, argv = move_dpo_knobs(data, argv, config_file, _flag(argv, "--dpo.loss_type"))
    training = data.get("training", {})
    objective = _flag(argv, "--training.objective") or (
        training.get("objective") if isinstance(training, dict) else None
    )
    job_config = job_config_class(_objective_sections(objective or "pretrain"))
    base = job_config()
    if config_file is not None:
        _apply_toml(base, data, config_file)
        base.job.config_file = config_file
    cfg = tyro.cli(job_config, prog=PROG, description=DESCRIPTION, args=argv, default=base, use_underscores=True)
    _find_shipped(cfg)
    given = _given_keys(argv, data)
    if reward_model is not None:
        prepend_reward_model(cfg.rl, reward_model, "rl.rewards" in given, "rl.reward_model_layout" in given)
    if resolve is not None:
        resolve(cfg, given)
    for problem in validate(cfg):
        raise ConfigError(problem)
    for setting in unread_settings(cfg):
        logger.warning(setting)
    return cfg


def _find_shipped(cfg: Any) -> None:
    """Every path setting that names a bundled file (``assets/...``) absent where the user stands points at the
    repository's (``titanium.config.shipped``)."""
    for section in (getattr(cfg, f.name) for f in dataclasses.fields(cfg)):
        for f in dataclasses.fields(section) if dataclasses.is_dataclass(section) else ():
            value = getattr(section, f.name)
            if isinstance(value, str) and shipped(value) != value:
                setattr(section, f.name, shipped(value))


def _objective_sections(objective: str) -> tuple[SectionSpec, ...]:
    """The sections of an objective given by import path (registered ones have theirs in the job config)."""
    if not isinstance(objective, str) or objective in OBJECTIVES or ":" not in objective:
        return ()  # (validation names what is wrong)
    section = OBJECTIVES.section(objective)
    return ((section,) if section is not None else ()) + OBJECTIVES.more_sections(objective)


def _flag(argv: list[str], name: str) -> str | None:
    """The value of ``--section.key`` in ``argv`` (also spelled with hyphens, or ``=value``), if given."""
    names = (name, name.replace("_", "-"))
    for i, arg in enumerate(argv):
        if arg in names:
            if i + 1 >= len(argv):
                raise ConfigError(f"{name} needs a value")
            return argv[i + 1]
        for spelling in names:
            if arg.startswith(spelling + "="):
                return arg.split("=", 1)[1]
    return None


def _given_keys(argv: list[str], data: dict[str, Any]) -> frozenset[str]:
    """The "section.key" names the TOML file and the command line set (a boolean's --section.no_key too)."""
    keys = {f"{section}.{key}" for section, values in data.items() if isinstance(values, dict) for key in values}
    for arg in argv:
        name = arg[2:].split("=", 1)[0].replace("-", "_") if arg.startswith("--") else ""
        section, dot, key = name.partition(".")
        if dot:
            keys |= {f"{section}.{key}", f"{section}.{key.removeprefix('no_')}"}
    return frozenset(keys)


def _read_toml(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file not found: {path} (check --job.config_file; configs live in train_configs/)")
    try:
        return tomllib.loads(file.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def _apply_toml(cfg: Any, data: dict[str, Any], where: str) -> None:
    """Copy TOML sections onto the default config, checking names and types."""
    sections = {f.name: f for f in dataclasses.fields(cfg)}
    for section_name, values in data.items():
        if section_name not in sections:
            raise ConfigError(f"{where}: unknown section [{section_name}]{_did_you_mean(section_name, sections)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{where}: '{section_name}' must be a [section] table, got {values!r}")
        _apply_table(getattr(cfg, section_name), values, section_name, where)


def _apply_table(section: Any, values: dict[str, Any], name: str, where: str) -> None:
    """Copy one TOML table onto its dataclass; a table inside it (``[dpo.simpo]``) onto the dataclass field."""
    hints = typing.get_type_hints(type(section))
    fields = {f.name for f in dataclasses.fields(section)}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(f"{where}: unknown key '{key}' in [{name}]{_did_you_mean(key, fields)}")
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: '{name}.{key}' must be a [{name}.{key}] table, got {value!r}")
            _apply_table(getattr(section, key), value, f"{name}.{key}", where)
            continue
        problem = _type_problem(value, hints[key])
        if problem:
            raise ConfigError(f"{where}: [{name}] {key} = {value!r}: {problem}")
        setattr(section, key, float(value) if _wants_float(hints[key]) and isinstance(value, int) else value)


def _did_you_mean(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else f"; valid: {', '.join(sorted(choices))}"


def _wants_float(hint: Any) -> bool:
    return hint is float or float in get_args(hint)


def _type_problem(value: Any, hint: Any) -> str | None:
    """Why `value` does not fit the annotation `hint`, or None when it does."""
    origin = get_origin(hint)
    if origin is Literal:
        choices = get_args(hint)
        return None if value in choices else f"expected one of {', '.join(map(repr, choices))}"
    if origin in (typing.Union, types.UnionType):
        options = [a for a in get_args(hint) if a is not type(None)]
        problems = [_type_problem(value, a) for a in options]
        return None if any(p is None for p in problems) else problems[0]
    if origin is list:
        if not isinstance(value, list):
            return "expected a list"
        (item,) = get_args(hint)
        for v in value:
            if (p := _type_problem(v, item)) is not None:
                return f"list item {v!r}: {p}"
        return None
    if hint is bool:
        return None if isinstance(value, bool) else "expected true or false"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "expected an integer"
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else "expected a number"
    if hint is str:
        return None if isinstance(value, str) else "expected a string"
    raise AssertionError(f"config field type {hint!r} has no TOML check; add it to _type_problem")


def to_toml_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as TOML-ready nested dicts (None values dropped: TOML has no null), without the sections
    of objectives the job does not train (``unread_sections``)."""
    unread = set(unread_sections(cfg.training.objective)) if OBJECTIVES.known(cfg.training.objective) else set()
    return {
        name: {k: v for k, v in section.items() if v is not None}
        for name, section in dataclasses.asdict(cfg).items()
        if name not in unread
    }
