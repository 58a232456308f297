"""Quantization-aware training as a model converter: torchao's ``QATConfig``, prepared now, converted at the end.

*Prepare* swaps the chosen ``nn.Linear`` layers for torchao's ``FakeQuantizedLinear``: the forward rounds the
weights (and, for 8da4w, each token's activations) to the integer grid the deployed model will use, while the
weights themselves stay in high precision and train through the rounding (straight-through estimator). The
parameter names do not change, so checkpoints, FSDP, PP and the Hugging Face export see the usual model.

*Convert* (``export``, at the end of training) applies the same scheme as torchao's post-training quantization
config to the trained weights, which is exactly what ``QATConfig(step="convert")`` does: the quantized model
computes what the fake-quantized one computed. It is written as safetensors in torchao's tensor-subclass layout
(``load_quantized`` reads it back into a model built as usual).

With LoRA (applied after this converter) the adapters wrap the fake-quantized layers
(``LoRAFakeQuantizedLinear``): the base runs as it will run quantized and the adapters learn around it, in high
precision; they are exported apart, as the PEFT adapter, and the quantized export holds the base.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor
from torchao.prototype.safetensors.safetensors_support import (
    flatten_tensor_state_dict,
    unflatten_tensor_state_dict,
)
from torchao.quantization import quantize_
from torchao.quantization.qat import FakeQuantizedLinear, QATConfig

from titanium.config.sections import QATSection
from titanium.files import replace_folder
from titanium.models.converter import ConverterContext, ExportContext, ModelConverter
from titanium.parallel.params import clean_fqn
from titanium.peft.lora import LORA_CLASSES, LoRALinear, is_lora_param
from titanium.quantize.schemes import SCHEMES, quantized_layers

logger = logging.getLogger("titanium")

WEIGHTS_FILE = "model.safetensors"
INFO_FILE = "quantization.json"


class LoRAFakeQuantizedLinear(LoRALinear, FakeQuantizedLinear):
    """LoRA on a fake-quantized layer: ``fq(W) fq(x) + scale * B A x``. The base forward is
    ``FakeQuantizedLinear``'s (next in the method order), the adapters run in high precision."""


LORA_CLASSES[FakeQuantizedLinear] = LoRAFakeQuantizedLinear


def base_config(cfg: QATSection) -> Any:
    """The torchao post-training config of ``cfg.scheme`` (schemes.py, shared with the serving export); QAT's
    prepare derives its fake quantizers from it."""
    return SCHEMES[cfg.scheme].config(cfg.group_size)


def qat_layers(model: nn.Module, cfg: QATSection) -> list[str]:
    """Names of the linear layers QAT quantizes: those not in ``filter_fqns``. A layer whose input size the group
    size does not divide, or whose weight is shared (tied embeddings), is a config error."""
    return quantized_layers(
        model, cfg.scheme, cfg.group_size, cfg.filter_fqns, flags=("--qat.group_size", "--qat.filter_fqns")
    )


class QATConverter(ModelConverter):
    """Fake-quantizes the linear layers ``qat_layers`` picks; exports them quantized at the end."""

    name = "qat"

    def __init__(self, cfg: QATSection) -> None:
        self.cfg = cfg
        self.layers: list[str] = []

    @classmethod
    def from_config(cls, section: QATSection, ctx: ConverterContext) -> QATConverter | None:
        return cls(section) if section.enable else None

    def convert(self, model: nn.Module) -> None:
        self.layers = qat_layers(model, self.cfg)
        chosen = set(self.layers)
        quantize_(
            model,
            QATConfig(base_config(self.cfg), step="prepare"),
            filter_fn=lambda module, name: clean_fqn(name) in chosen,
        )
        logger.info("QAT (%s, group size %d) on %d linear layers", self.cfg.scheme, self.cfg.group_size, len(chosen))

    @contextlib.contextmanager
    def _fake_quantization_off(self, model: nn.Module) -> Iterator[None]:
        quantizers = [
            quantizer
            for module in model.modules()
            if isinstance(module, FakeQuantizedLinear)
            for quantizer in (module.activation_fake_quantizer, module.weight_fake_quantizer)
            if quantizer is not None
        ]
        for quantizer in quantizers:
            quantizer.enabled = False
        try:
            yield
        finally:
            for quantizer in quantizers:
                quantizer.enabled = True

    def without_conversion(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return self._fake_quantization_off(model)

    def export(self, model: nn.Module, ctx: ExportContext) -> None:
        if self.cfg.save_quantized:
            save_quantized(model, self.cfg, ctx, self.layers)

    def describe(self) -> str:
        return f"QAT {self.cfg.scheme}"


def _full_state_dict(model: nn.Module, pp_group: dist.ProcessGroup | None) -> dict[str, torch.Tensor] | None:
    """The whole model's weights on CPU, under clean names, without LoRA adapters: on rank 0 (None elsewhere).
    Collective when distributed (sharded tensors are gathered one at a time); with pipeline stages spread over
    ranks, the stages' weights are collected over ``pp_group``."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    keep = rank == 0 or pp_group is not None
    state = {}
    for key, value in model.state_dict().items():
        if is_lora_param(key):
            continue
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if keep:
            state[clean_fqn(key)] = full.detach().cpu()
    if pp_group is not None:
        stages: list[Any] = [None] * dist.get_world_size(pp_group)
        dst = dist.get_global_rank(pp_group, 0)
        dist.gather_object(state, stages if rank == dst else None, dst=dst, group=pp_group)
        if rank == dst:
            state = {k: v for stage in stages for k, v in stage.items()}
    return state if rank == 0 else None


def save_quantized(model: nn.Module, cfg: QATSection, ctx: ExportContext, layers: list[str]) -> Path | None:
    """Convert: quantize the trained weights of ``layers`` by ``cfg.scheme`` and write them to
    ``{dump_folder}/{quantized_folder}`` (collective when distributed; rank 0 writes). Returns the folder on
    rank 0, None elsewhere. The folder appears complete or not at all."""
    state = _full_state_dict(model, ctx.pp_group)
    path = None
    if state is not None:
        with torch.device("meta"):
            plain = ctx.spec.model_cls(ctx.args)
        plain.load_state_dict(state, assign=True)
        chosen = set(layers)
        quantize_(plain, base_config(cfg), filter_fn=lambda module, name: name in chosen)
        tensors, metadata = flatten_tensor_state_dict({k: _own(v) for k, v in plain.state_dict().items()})
        path = Path(ctx.dump_folder) / cfg.quantized_folder
        partial = path.with_name(f".{path.name}.partial")
        partial.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(partial / WEIGHTS_FILE), metadata)
        info = {"scheme": cfg.scheme, "group_size": cfg.group_size, "layers": layers, "model": ctx.spec.name}
        (partial / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        replace_folder(partial, path)
        logger.info("saved the QAT-quantized model (%s, %d layers) to %s", cfg.scheme, len(layers), path)
    if dist.is_initialized():
        dist.barrier()
    return path


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor with storage of its own (safetensors refuses shared storage: tied embeddings)."""
    return tensor.clone() if type(tensor) is torch.Tensor else tensor


def load_quantized(model: nn.Module, folder: str | Path) -> nn.Module:
    """Load a ``save_quantized`` folder into ``model``, a titanium decoder built as it was trained but without
    converters (e.g. on the meta device: ``spec.model_cls(args)``); its quantized layers then compute with
    torchao's quantized tensors. The weights land on the CPU (move the model with ``.to``). Returns ``model``."""
    file = Path(folder) / WEIGHTS_FILE
    with safe_open(str(file), framework="pt") as f:
        metadata = f.metadata()
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    state, leftover = unflatten_tensor_state_dict(tensors, metadata)
    if leftover:
        raise ValueError(f"{file}: tensors without metadata: {', '.join(sorted(leftover))}")
    model.load_state_dict(state, assign=True)
    model.init_buffers("cpu")  # the RoPE tables, derived rather than saved
    return model
