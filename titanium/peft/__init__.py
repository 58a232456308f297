"""Parameter-efficient fine-tuning: LoRA / QLoRA adapters, merging, and PEFT-layout export."""

from titanium.peft.export import export_peft_adapter, peft_state_dict
from titanium.peft.lora import (
    LoRAConfigError,
    LoRALinear,
    apply_lora,
    check_lora_config,
    freeze_base,
    has_lora,
    init_lora,
    is_lora_param,
    lora_state_dict,
    quantize_lora_base_nf4,
)
from titanium.peft.merge import lora_scales, merge_lora, merge_lora_state, merged_full_state_dict

__all__ = [
    "LoRAConfigError",
    "LoRALinear",
    "apply_lora",
    "check_lora_config",
    "export_peft_adapter",
    "freeze_base",
    "has_lora",
    "init_lora",
    "is_lora_param",
    "lora_scales",
    "lora_state_dict",
    "merge_lora",
    "merge_lora_state",
    "merged_full_state_dict",
    "peft_state_dict",
    "quantize_lora_base_nf4",
]
