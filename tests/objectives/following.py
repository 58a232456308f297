"""A test-only objective that follows the policy's weights as a rollout engine would (not shipped): pretraining
that records every update its policy handle reports (``on_update``: after load, after each optimizer step)."""

from __future__ import annotations

from titanium.config.sections import DataSection
from titanium.objectives.base import ObjectiveContext
from titanium.objectives.pretrain import PretrainObjective


class PolicyFollower(PretrainObjective):
    def __init__(self, ctx: ObjectiveContext, data: DataSection, section: None = None) -> None:
        super().__init__(ctx, data)
        assert ctx.models is not None
        self.updates: list[int] = []
        ctx.models.policy().on_update(self.updates.append)
