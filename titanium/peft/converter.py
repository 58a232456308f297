"""LoRA and QLoRA as a model converter: adapters on the meta model, a frozen base, PEFT export at the end."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from torch import nn

from titanium.config.sections import LoRASection
from titanium.models.converter import ConverterContext, ExportContext, ModelConverter
from titanium.models.hf_adapter import HFAdapter
from titanium.peft.expert_lora import expert_lora_modules
from titanium.peft.export import export_peft_adapter
from titanium.peft.lora import apply_lora, init_lora, is_lora_param, lora_modules, lora_scale, quantize_lora_base_nf4

logger = logging.getLogger("titanium")


class LoRAConverter(ModelConverter):
    """Adds adapters to ``cfg.target_modules``; only they train. With ``quantize_base = "nf4"`` (QLoRA) the
    frozen base is stored as NF4, which needs whole tensors: the model is materialized before sharding.

    ``shard_degree`` is how many FSDP shards each NF4 weight will be split into (dp_shard x cp).
    """

    name = "lora"
    freezes_base = True

    def __init__(self, cfg: LoRASection, shard_degree: int = 1, hf_adapter: HFAdapter | None = None) -> None:
        self.cfg = cfg
        self.shard_degree = shard_degree
        self.hf_adapter = hf_adapter  # (for target_modules spelled as PEFT spells them)
        self.materialize_before_parallelize = cfg.quantize_base == "nf4"

    @classmethod
    def from_config(cls, section: LoRASection, ctx: ConverterContext) -> LoRAConverter | None:
        return cls(section, ctx.shard_degree, ctx.hf_adapter) if section.rank > 0 else None

    def convert(self, model: nn.Module) -> None:
        adapted = apply_lora(model, self.cfg, self.hf_adapter)
        logger.info(
            "%s rank %d on %d layers (%s), scale %g",
            "DoRA" if self.cfg.use_dora else "LoRA",
            self.cfg.rank,
            len(adapted),
            ", ".join(self.cfg.target_modules),
            lora_scale(self.cfg),
        )

    def after_materialize(self, model: nn.Module, seed: int) -> None:
        if self.materialize_before_parallelize:
            count = quantize_lora_base_nf4(model, shard_degree=self.shard_degree)
            logger.info("QLoRA: %d base weights stored as NF4", count)
        init_lora(model, seed=seed)  # after NF4: DoRA's magnitudes are the norms of the weights as they compute

    def trainable(self, name: str) -> bool:
        return is_lora_param(name)

    @contextlib.contextmanager
    def _adapters_off(self, model: nn.Module) -> Iterator[None]:
        modules = [module for _, module in [*lora_modules(model), *expert_lora_modules(model)]]
        for module in modules:
            module.lora_enabled = False
        try:
            yield
        finally:
            for module in modules:
                module.lora_enabled = True

    def without_conversion(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return self._adapters_off(model)

    def export(self, model: nn.Module, ctx: ExportContext) -> None:
        """The adapters alone in PEFT layout (``peft.PeftModel.from_pretrained`` on the base model loads them)."""
        if not self.cfg.save_adapter:
            return
        if ctx.spec.hf_adapter is None:
            logger.warning("not saving the LoRA adapter: model %s has no Hugging Face adapter", ctx.spec.name)
            return
        path = export_peft_adapter(
            model,
            ctx.spec.hf_adapter,
            ctx.args,
            self.cfg,
            ctx.dump_folder / ctx.folder(self.cfg.adapter_folder),
            base_model_name_or_path=ctx.base_model_name_or_path,
            pp_group=ctx.pp_group,
        )
        if path is not None and ctx.save_tokenizer is not None:  # (as TRL's adapter folders carry it)
            ctx.save_tokenizer(path)

    def describe(self) -> str:
        kind = "DoRA" if self.cfg.use_dora else "LoRA"
        return f"Q{kind} (NF4 base)" if self.materialize_before_parallelize else kind
