"""``[vision] freeze_vision_tower`` / ``freeze_projector`` as a converter: which of an image-text model's vision
parameters train. The model names its vision parts (``ImageTextModel.vision_names``); the projector is what maps
image features to the language model's width (``multi_modal_projector``, Qwen's patch ``merger``s), the tower the
rest of those parts."""

from __future__ import annotations

import re

from torch import nn

from titanium.config.errors import ConfigError
from titanium.config.vision_section import VisionSection
from titanium.models.converter import ConverterContext, ModelConverter
from titanium.parallel.params import clean_fqn

PROJECTOR = re.compile(r"(^|\.)(multi_modal_projector|merger|deepstack_merger_list)(\.|$)")
"""Names of the projector's modules, in every architecture titanium feeds images to."""


def is_projector(name: str) -> bool:
    """Whether parameter ``name`` (inside a vision part) belongs to the projector."""
    return PROJECTOR.search(name) is not None


class VisionFreezeConverter(ModelConverter):
    """Says the frozen vision parts do not train (converts nothing)."""

    name = "vision"

    def __init__(self, cfg: VisionSection) -> None:
        self.cfg = cfg
        self.parts: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, section: VisionSection, ctx: ConverterContext) -> VisionFreezeConverter | None:
        return cls(section) if section.freeze_vision_tower or section.freeze_projector else None

    def convert(self, model: nn.Module) -> None:
        self.parts = tuple(getattr(model, "vision_names", ()))
        if not self.parts:
            raise ConfigError(
                "--vision.freeze_vision_tower / --vision.freeze_projector: the model reads no images (it is not an "
                "image-text model); leave them off"
            )

    def trainable(self, name: str) -> bool | None:
        name = clean_fqn(name)
        if name.split(".", 1)[0] not in self.parts:
            return None
        frozen = self.cfg.freeze_projector if is_projector(name) else self.cfg.freeze_vision_tower
        return False if frozen else None

    def describe(self) -> str:
        frozen = [
            part
            for part, on in (("vision tower", self.cfg.freeze_vision_tower), ("projector", self.cfg.freeze_projector))
            if on
        ]
        return f"vision ({' and '.join(frozen)} frozen)"
