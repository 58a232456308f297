"""The job's model converters, built from their own config sections, in the order they must apply.

Order: quantization (Float8, QAT) before LoRA, so LoRA adapts the layers as they will run.
"""

from __future__ import annotations

from titanium.config.sections import LoRASection
from titanium.models.converter import ModelConverter
from titanium.peft.converter import LoRAConverter


def build_converters(*, lora: LoRASection, shard_degree: int) -> list[ModelConverter]:
    """The converters the config turns on (none by default). ``shard_degree``: FSDP shards per weight."""
    converters: list[ModelConverter] = []
    if lora.rank > 0:
        converters.append(LoRAConverter(lora, shard_degree=shard_degree))
    return converters
