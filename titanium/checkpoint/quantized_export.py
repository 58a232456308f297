"""Quantized Hugging Face checkpoints for serving: torchao post-training quantization of a trained model.

``export_quantized_hf`` reads a Hugging Face folder of a supported family (titanium's own export, or any
checkpoint of the family), quantizes its linear layers with a scheme from schemes.py, and writes the folder as
``transformers`` writes a model loaded with ``TorchAoConfig``: one ``model.safetensors`` in torchao's flattened
layout (``..._weight_qdata``, ``..._weight_scale``... with each tensor's layout in the file's metadata) and
``config.json`` with its ``quantization_config``. ``AutoModelForCausalLM.from_pretrained(out)`` then computes with
torchao's quantized tensors, and so does a titanium model after ``quantize_model`` (the reference the tests
compare the export with).

The weights are quantized as they are stored, in Hugging Face layout (q/k rows in rotate-half order). Every
scheme here quantizes each output row on its own (scales per row or per group of a row's inputs), so quantizing
and then permuting rows gives the tensors titanium's model holds after ``quantize_model``.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from torchao.core.config import config_to_dict
from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict
from torchao.quantization import quantize_

from titanium.checkpoint.hf import (
    CONFIG_FILE,
    SINGLE_FILE,
    HFCheckpoint,
    check_hf_keys,
    config_with_dtype,
    copy_side_files,
    hf_model_args,
)
from titanium.config.loader import ConfigError
from titanium.files import replace_folder
from titanium.models import get_model_spec
from titanium.parallel.params import clean_fqn
from titanium.quantize.schemes import SCHEMES, check_device, quantized_layers

logger = logging.getLogger("titanium")


def quantize_model(model: nn.Module, scheme: str, group_size: int, layers: Iterable[str]) -> nn.Module:
    """Quantize ``layers`` (clean names) of a titanium model in place with ``scheme``; returns the model."""
    chosen = set(layers)
    quantize_(model, SCHEMES[scheme].config(group_size), filter_fn=lambda module, name: clean_fqn(name) in chosen)
    return model


def quantize_weight(weight: torch.Tensor, config: Any) -> torch.Tensor:
    """One linear weight ``[out, in]`` quantized by torchao ``config`` (a tensor subclass on ``weight``'s device)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    quantize_(linear, config)
    return linear.weight.detach()


def hf_quantization_config(config: Any, modules_to_not_convert: list[str]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config``: ``transformers.TorchAoConfig(config, modules_to_not_convert)
    .to_dict()``, written without importing transformers."""
    return {
        "quant_method": "torchao",
        "quant_type": {"default": config_to_dict(config)},
        "modules_to_not_convert": modules_to_not_convert,
        "include_input_output_embeddings": False,
        "untie_embedding_weights": False,
    }


def _device_for(scheme: str) -> torch.device:
    return torch.device("cuda" if SCHEMES[scheme].cuda_capability and torch.cuda.is_available() else "cpu")


def export_quantized_hf(
    folder: str | Path,
    out: str | Path,
    model: str,
    scheme: str,
    *,
    group_size: int = 32,
    filter_fqns: Iterable[str] = ("output",),
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Quantize the HF checkpoint ``folder`` of family ``model`` by ``scheme`` into the HF folder ``out``.

    Linear layers whose titanium name contains one of ``filter_fqns`` stay in ``dtype``, as do embeddings and
    norms. Schemes with CUDA kernels quantize on the GPU; the others on the CPU. ``out`` appears complete or not
    at all. Bad input (a folder of another architecture, sizes the scheme cannot take, a CUDA scheme without a
    GPU) raises a ``UserError`` naming the fix.
    """
    spec = get_model_spec(model)
    adapter = spec.hf_adapter
    if adapter is None:
        raise ConfigError(f"model {model!r} has no Hugging Face adapter")
    args = hf_model_args(spec, folder, option="FOLDER", family_option="--model")
    source = HFCheckpoint.open(folder, "FOLDER")
    with torch.device("meta"):
        net = spec.model_cls(args)
    check_hf_keys(source, adapter, args, {k: tuple(v.shape) for k, v in net.state_dict().items()})
    layers = quantized_layers(net, scheme, group_size, filter_fqns)
    device = _device_for(scheme)
    check_device(scheme, device)
    need = SCHEMES[scheme].dtype
    if need is not None and dtype != need:
        raise ConfigError(
            f"--scheme {scheme} quantizes {need} weights: pass --dtype {str(need).removeprefix('torch.')}"
        )
    config = SCHEMES[scheme].config(group_size)
    chosen = {adapter.hf_key(f"{layer}.weight") for layer in layers}
    tensors: dict[str, torch.Tensor] = {}
    for file in source.files:  # one source file in memory at a time
        part = source.read([key for key, name in source.weight_map.items() if name == file])
        for key, value in part.items():
            value = value.to(device, dtype)
            tensors[key] = quantize_weight(value, config) if key in chosen else value.cpu()
    kept = sorted(
        {
            adapter.hf_key(f"{clean_fqn(name)}.weight").removesuffix(".weight")
            for name, module in net.named_modules()
            if isinstance(module, nn.Linear) and clean_fqn(name) not in layers
        }
    )
    flat, metadata = flatten_tensor_state_dict(tensors)
    out = Path(out)
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(
        {k: v.cpu().contiguous() for k, v in flat.items()}, str(partial / SINGLE_FILE), {**metadata, "format": "pt"}
    )
    hf_config = config_with_dtype(source.config, dtype)
    hf_config["quantization_config"] = hf_quantization_config(config, kept)
    (partial / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    copy_side_files(source.folder, partial)
    replace_folder(partial, out)
    logger.info("saved %s (%s, %d of %d linear layers quantized)", out, scheme, len(layers), len(layers) + len(kept))
    return out
