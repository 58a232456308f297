"""Training objectives. Each is one file plus its config section; `build_objective` picks one."""

from __future__ import annotations

from titanium.config.sections import DataSection, SFTSection
from titanium.trainers.base import Objective, ObjectiveContext
from titanium.trainers.pretrain import PretrainObjective


def build_objective(name: str, ctx: ObjectiveContext, data: DataSection, sft: SFTSection) -> Objective:
    if name == "pretrain":
        return PretrainObjective(ctx, data)
    if name == "sft":
        from titanium.trainers.sft import SFTObjective

        return SFTObjective(ctx, data, sft)
    raise ValueError(f"unknown --training.objective {name!r}; available: pretrain, sft")


__all__ = ["Objective", "ObjectiveContext", "build_objective"]
