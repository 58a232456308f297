"""The job's model converters, built from their own config sections, in the order they must apply.

Order: quantization (Float8, QAT) before LoRA, so LoRA adapts the layers as they will run. The torchao
converters are imported only when switched on (torchao is slow to import).
"""

from __future__ import annotations

from titanium.config.sections import Float8Section, LoRASection, QATSection
from titanium.models.converter import ModelConverter
from titanium.peft.converter import LoRAConverter


def build_converters(
    *,
    lora: LoRASection,
    float8: Float8Section,
    qat: QATSection,
    shard_degree: int,
    fsdp: bool,
    device_type: str | None,
) -> list[ModelConverter]:
    """The converters the config turns on (none by default). ``shard_degree``: FSDP shards per weight;
    ``fsdp``: weights are FSDP-sharded; ``device_type``: where the run computes (None: a dry run, no
    hardware checks)."""
    converters: list[ModelConverter] = []
    if float8.enable:
        from titanium.quantize.float8 import Float8Converter

        converters.append(Float8Converter(float8, fsdp=fsdp, device_type=device_type))
    if qat.enable:
        from titanium.quantize.qat import QATConverter

        converters.append(QATConverter(qat))
    if lora.rank > 0:
        converters.append(LoRAConverter(lora, shard_degree=shard_degree))
    return converters
