"""Training objectives. Each is one file plus its config section; `build_objective` picks one by name.

An objective named ``x`` is configured by the job's ``[x]`` section (none for pretraining), which the
loop hands it; nothing else in the loop knows which objective runs.
"""

from __future__ import annotations

import importlib
from typing import Any

from titanium.config.loader import ConfigError
from titanium.config.sections import DataSection
from titanium.trainers.base import Objective, ObjectiveContext

OBJECTIVES = {
    "pretrain": "titanium.trainers.pretrain:PretrainObjective",
    "sft": "titanium.trainers.sft:SFTObjective",
    "dpo": "titanium.trainers.dpo:DPOObjective",
    "grpo": "titanium.trainers.grpo:GRPOObjective",
}
"""Objective name -> ``module:class``; the class takes ``(ObjectiveContext, DataSection, its own section)``."""


def build_objective(name: str, ctx: ObjectiveContext, data: DataSection, section: Any) -> Objective:
    """The objective called ``name`` (built in) or at the import path ``package.module:ClassName``."""
    path = OBJECTIVES.get(name, name)
    module_name, _, cls_name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"--training.objective {name!r}: cannot import {path} ({e})") from None
    return cls(ctx, data, section)


__all__ = ["OBJECTIVES", "Objective", "ObjectiveContext", "build_objective"]
