"""Training objectives. Each is one file plus its config section, registered by name in
titanium/config/components.py; ``build_objective`` makes one by name or import path.

An objective is handed its own config section (none for pretraining) and nothing else of the job config; nothing
in the loop knows which objective runs.
"""

from __future__ import annotations

from typing import Any

from titanium.config.components import OBJECTIVES
from titanium.config.sections import DataSection
from titanium.objectives.base import Objective, ObjectiveContext


def build_objective(name: str, ctx: ObjectiveContext, data: DataSection, cfg: Any) -> Objective:
    """The objective registered as ``name`` (or at the import path ``package.module:ClassName``), given its own
    section of the job config ``cfg`` and, by keyword, the further sections it reads."""
    section = OBJECTIVES.section(name)
    more = {spec.name: getattr(cfg, spec.name) for spec in OBJECTIVES.more_sections(name)}
    return OBJECTIVES.load(name)(ctx, data, getattr(cfg, section.name) if section is not None else None, **more)


__all__ = ["Objective", "ObjectiveContext", "build_objective"]
