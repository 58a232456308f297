"""Write the trained adapters as a PEFT LoRA adapter (``adapter_config.json``, ``adapter_model.safetensors``).

``peft.PeftModel.from_pretrained(hf_model, folder)`` then reproduces the titanium model. Names and RoPE
layout come from the family's Hugging Face adapter (``titanium/models/<family>/hf.py``), the very code that
converts the base weights, so the two cannot drift apart: ``lora_B`` produces the rows of the layer's
output and gets whatever row permutation the adapter gives the base weight (the q/k RoPE permutation,
for every family whose adapter lists them in ``rope_keys``); so does DoRA's magnitude vector, one value per
output row (PEFT's ``lora_magnitude_vector``). ``lora_A`` acts on the input side, which no adapter permutes, and
is only renamed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from titanium.config.sections import LoRASection
from titanium.files import replace_folder
from titanium.models.hf_adapter import HFAdapter, HFExportError, split_layer_key
from titanium.peft.expert_lora import PROJECTIONS, expert_lora_modules
from titanium.peft.lora import adapter_key_parts, lora_modules, lora_scale, lora_state_dict

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


def peft_state_dict(tensors: Mapping[str, torch.Tensor], adapter: HFAdapter, args: Any) -> dict[str, torch.Tensor]:
    """Our adapter tensors (``layers.0.attention.wq.lora_b.weight``) -> PEFT names and layout
    (``base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight``).

    Layers that the checkpoint fuses into one tensor (Phi-3's ``qkv_proj`` holds wq, wk and wv) get one adapter
    of their summed rank: ``lora_A`` stacks the parts' A rows, ``lora_B`` places each part's B in that part's
    rows and rank columns (block diagonal), so ``B A`` is each part's update in its own rows (``fused_ranks``);
    DoRA's magnitudes, one per output row, are placed the same way.
    """
    experts = {key: value for key, value in tensors.items() if _memory_expert(adapter_key_parts(key)[0], adapter)}
    out = peft_expert_state_dict(experts, adapter)
    groups: dict[str, list[str]] = {}  # HF weight -> our adapted layers, in the order of our names
    for key in tensors:
        if key in experts:
            continue
        layer, _ = adapter_key_parts(key)
        hf_key = adapter.hf_key(f"{layer}.weight")
        if layer not in groups.setdefault(hf_key, []):
            groups[hf_key].append(layer)
    for hf_key, layers in groups.items():
        a = torch.cat([tensors[f"{layer}.lora_a.weight"] for layer in layers])
        columns = []
        for layer in layers:  # each part's B through the adapter: renamed, permuted, placed in its rows
            converted = adapter.to_hf({f"{layer}.weight": tensors[f"{layer}.lora_b.weight"]}, args)
            if list(converted) != [hf_key]:
                raise ValueError(f"{layer}.weight has no Hugging Face tensor of its own (tied embeddings?)")
            columns.append(converted[hf_key])
        prefix = f"{_PEFT_PREFIX}{adapter.module_key(hf_key).removesuffix('.weight')}"
        out[f"{prefix}.lora_A.weight"] = a.contiguous()
        out[f"{prefix}.lora_B.weight"] = torch.cat(columns, dim=1).contiguous()  # (zero outside each part's rows)
        if f"{layers[0]}.lora_magnitude" in tensors:  # each part's magnitudes in its rows, zeros elsewhere: sum
            parts = [adapter.to_hf({f"{layer}.weight": tensors[f"{layer}.lora_magnitude"]}, args) for layer in layers]
            magnitude = sum(part[hf_key] for part in parts)
            if magnitude.shape[0] != sum(tensors[f"{layer}.lora_magnitude"].shape[0] for layer in layers):
                raise ValueError(  # PEFT's DoRA rescales every row of the fused tensor, adapted by us or not
                    f"{hf_key} fuses more layers than the adapted {layers}: a DoRA adapter of it needs all of "
                    "them in lora.target_modules (or use_dora = false)"
                )
            out[f"{prefix}.lora_magnitude_vector"] = magnitude.contiguous()
    return out


def _memory_expert(layer: str, adapter: HFAdapter) -> tuple[str, str, int] | None:
    """For an adapted stacked expert weight (``layers.0.moe.experts.w1``): (layer number, the HF in-memory
    parameter that holds it, our part's index in it); None for any other layer."""
    split = split_layer_key(layer)
    if split is None or split[1] not in adapter.memory_expert_params:
        return None
    return (split[0], *adapter.memory_expert_params[split[1]])


def _hf_leaf(layer: str, adapter: HFAdapter) -> str:
    """The HF name PEFT's patterns match: the module's leaf (``q_proj``), or a stacked expert parameter's name."""
    expert = _memory_expert(layer, adapter)
    if expert is not None:
        return expert[1].rsplit(".", 1)[-1]
    return adapter.hf_key(f"{layer}.weight").removesuffix(".weight").rsplit(".", 1)[-1]


def fused_ranks(layers: list[str], adapter: HFAdapter) -> dict[str, int]:
    """PEFT module (or stacked parameter) name -> how many of our adapted layers its one adapter stacks, where more
    than one."""
    counts: dict[str, set[str]] = {}
    for layer in layers:
        counts.setdefault(_hf_leaf(layer, adapter), set()).add(layer.rsplit(".", 1)[-1])
    return {leaf: len(parts) for leaf, parts in counts.items() if len(parts) > 1}


def hf_target_modules(layers: list[str], adapter: HFAdapter) -> list[str]:
    """Our adapted layer names -> PEFT's ``target_modules`` (HF leaf names: ``q_proj``, ``lm_head``...)."""
    return sorted({_hf_leaf(layer, adapter) for layer in layers if _memory_expert(layer, adapter) is None})


def exact_target_pattern(layers: list[str], adapter: HFAdapter) -> str:
    """PEFT's ``target_modules`` as one regular expression naming each adapted layer by its whole name in
    ``transformers``' model. An image-text model's vision tower reuses its language model's leaf names (``q_proj``,
    ``down_proj``; a Sequential's ``0``), so leaf names would make PEFT adapt layers titanium did not."""
    names = {adapter.module_key(adapter.hf_key(f"{layer}.weight")).removesuffix(".weight") for layer in layers}
    return "|".join(re.escape(name) for name in sorted(names))


def hf_target_parameters(layers: list[str], adapter: HFAdapter) -> list[str]:
    """Our adapted stacked expert weights -> PEFT's ``target_parameters`` (``mlp.experts.gate_up_proj``), in the
    order the HF module declares them, which is the order PEFT wraps them in: the first innermost."""
    adapted = {expert[1] for layer in layers if (expert := _memory_expert(layer, adapter)) is not None}
    declared = dict.fromkeys(name for name, _ in adapter.memory_expert_params.values())
    return [name for name in declared if name in adapted]


def peft_expert_state_dict(tensors: Mapping[str, torch.Tensor], adapter: HFAdapter) -> dict[str, torch.Tensor]:
    """Our stacked expert adapters (``layers.0.moe.experts.lora_a.w1`` ``[E, r, in]``, ``lora_b`` ``[E, out, r]``)
    -> PEFT's adapters of transformers' stacked expert parameters.

    PEFT keeps one ``lora_A`` ``[E r, in]`` (expert-major rows) and one ``lora_B`` ``[out, r E]`` (expert-minor
    columns) per parameter. A parameter that concatenates several of ours along its rows (``gate_up_proj``: w1,
    w3) gets their summed rank, A stacked and B block diagonal, as ``peft_state_dict`` does for fused layers.
    Several parameters of one module nest: the first of ``hf_target_parameters`` is wrapped innermost, each
    wrapper adding a ``base_layer`` to the names inside it.
    """
    keys = {adapter_key_parts(key): key for key in tensors}  # (our layer, lora_a) -> key
    groups: dict[tuple[str, str], dict[int, str]] = {}  # (layer number, HF parameter) -> part index -> our layer
    for layer, _ in keys:
        number, parameter, part = _memory_expert(layer, adapter)  # type: ignore[misc]
        groups.setdefault((number, parameter), {})[part] = layer
    order = hf_target_parameters([layer for layer, _ in keys], adapter)
    out = {}
    for (number, parameter), parts in groups.items():
        layers = [parts[i] for i in sorted(parts)]
        a = torch.cat([tensors[keys[layer, "lora_a"]] for layer in layers], dim=1)  # [E, n r, in]
        bs = [tensors[keys[layer, "lora_b"]] for layer in layers]  # each [E, out_k, r]
        rank = bs[0].shape[2]
        b = a.new_zeros(a.shape[0], sum(part.shape[1] for part in bs), rank * len(bs))
        row = 0
        for k, part in enumerate(bs):  # block diagonal: part k's rows, part k's rank columns
            b[:, row : row + part.shape[1], k * rank : (k + 1) * rank] = part
            row += part.shape[1]
        module = parameter.rpartition(".")[0]
        siblings = [p for p in order if p.rpartition(".")[0] == module]
        wrappers_outside = len(siblings) - 1 - siblings.index(parameter)
        prefix = f"{_PEFT_PREFIX}model.layers.{number}.{module}" + ".base_layer" * wrappers_outside
        out[f"{prefix}.lora_A.weight"] = a.reshape(-1, a.shape[-1]).contiguous()
        out[f"{prefix}.lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], -1).contiguous()
    return out


def adapter_config(
    cfg: LoRASection,
    target_modules: list[str] | str,
    base_model_name_or_path: str | None,
    fused: Mapping[str, int] | None = None,
    target_parameters: list[str] | None = None,
) -> dict:
    """The ``adapter_config.json`` of a LoRA (DoRA, rsLoRA) adapter for a causal LM (PEFT's ``LoraConfig``). A
    module whose adapter stacks ``n`` of ours (``fused``) has rank ``n r`` and the alpha that keeps our scale:
    ``n alpha`` (``alpha / r``) or ``sqrt(n) alpha`` with rsLoRA (``alpha / sqrt(r)``). ``target_parameters``:
    stacked expert parameters (PEFT's LoRA on ``nn.Parameter``s), in the order PEFT wraps them."""
    fused = fused or {}
    alpha_factor = (lambda n: n**0.5) if cfg.use_rslora else (lambda n: n)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": target_modules,
        "target_parameters": target_parameters or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": cfg.use_rslora,
        "use_dora": cfg.use_dora,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {leaf: n * cfg.rank for leaf, n in fused.items()},
        "alpha_pattern": {leaf: alpha_factor(n) * cfg.alpha for leaf, n in fused.items()},
    }


def _check_matches(model: nn.Module, cfg: LoRASection) -> list[str]:
    """This model's adapted layers, checked against ``cfg`` (a pipeline stage may have none)."""
    layers = []
    for name, module in lora_modules(model):
        rank, dora = module.lora_a.out_features, module.lora_magnitude is not None
        if rank != cfg.rank or abs(module.lora_scale - lora_scale(cfg)) > 1e-12 * module.lora_scale:
            raise ValueError(f"{name}: rank {rank}, scale {module.lora_scale} do not match {cfg}")
        if dora != cfg.use_dora:
            raise ValueError(f"{name}: {'a' if dora else 'no'} DoRA magnitude, but use_dora={cfg.use_dora}")
        layers.append(name)
    for name, experts in expert_lora_modules(model):
        rank = experts.lora_a.w1.shape[1]
        if rank != cfg.rank or abs(experts.lora_scale - lora_scale(cfg)) > 1e-12 * experts.lora_scale:
            raise ValueError(f"{name}: rank {rank}, scale {experts.lora_scale} do not match {cfg}")
        layers += [f"{name}.{projection}" for projection in PROJECTIONS]
    return layers


def check_adapter_export(model: nn.Module, adapter: HFAdapter, cfg: LoRASection) -> None:
    """What ``export_peft_adapter`` would refuse at the end of training, checked on the model as built (on the meta
    device too: titanium.preflight, before the run starts)."""
    check_peft_loads(_check_matches(model, cfg), adapter)


def check_peft_loads(layers: list[str], adapter: HFAdapter) -> None:
    """Refuse adapters that ``peft`` would put elsewhere. On transformers 5 PEFT reads the per-expert names of a
    family with stacked experts (Qwen3-MoE's ``gate_proj``/``up_proj``/``down_proj``) as the experts' stacked
    parameters, so an adapter of a dense MLP layer of such a model (``mlp_only_layers``) would load onto the experts.
    """
    if not adapter.memory_expert_params:
        return
    per_expert = {template.rsplit(".", 2)[-2] for template in adapter.expert_keys.values()}
    dense = sorted(
        {_hf_leaf(layer, adapter) for layer in layers if _memory_expert(layer, adapter) is None} & per_expert
    )
    if dense:
        raise HFExportError(
            f"cannot export the LoRA adapters of the dense MLP layers ({', '.join(dense)}) of this "
            f"{adapter.model_type} model in PEFT layout: peft on transformers 5 loads those names onto the stacked "
            "experts. Drop mlp from --lora.target_modules (experts and attention adapters export), or turn off "
            "--lora.save_adapter and use the merged export (--checkpoint.last_save_in_hf)"
        )


def export_peft_adapter(
    model: nn.Module,
    hf_adapter: HFAdapter,
    model_args: Any,
    cfg: LoRASection,
    folder: str | os.PathLike,
    base_model_name_or_path: str | None = None,
    *,
    pp_group: dist.ProcessGroup | None = None,
) -> Path | None:
    """Gather the adapters (collective when distributed: every rank calls) and write them on rank 0.

    DTensor (FSDP) adapters are gathered with ``full_tensor``; with pipeline parallelism pass the
    ``pp_group``, whose ranks hold the other stages' layers, and rank 0 collects them from it. The
    folder appears complete or not at all (written as ``.<name>.partial`` then renamed). Returns the
    folder on rank 0, None elsewhere.
    """
    layers = _check_matches(model, cfg)
    check_peft_loads(layers, hf_adapter)
    if not layers and pp_group is None:
        raise ValueError("export_peft_adapter: the model has no LoRA layers")
    rank = dist.get_rank() if dist.is_initialized() else 0
    keep = rank == 0 or pp_group is not None
    tensors = {}
    for key, param in lora_state_dict(model).items():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        if keep:
            tensors[key] = full.detach().to("cpu").contiguous()
    if pp_group is not None:
        stages: list[Any] = [None] * dist.get_world_size(pp_group)
        dst = dist.get_global_rank(pp_group, 0)
        dist.gather_object((layers, tensors), stages if rank == dst else None, dst=dst, group=pp_group)
        if rank == dst:
            layers = sorted({layer for stage_layers, _ in stages for layer in stage_layers})
            tensors = {key: value for _, stage_tensors in stages for key, value in stage_tensors.items()}
    path = None
    if rank == 0:
        path = Path(folder)
        partial = path.with_name(f".{path.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        save_file(peft_state_dict(tensors, hf_adapter, model_args), str(partial / WEIGHTS_FILE), {"format": "pt"})
        exact = bool(getattr(model, "vision_names", ()))  # (an image-text model: see exact_target_pattern)
        targets = exact_target_pattern(layers, hf_adapter) if exact else hf_target_modules(layers, hf_adapter)
        fused = fused_ranks(layers, hf_adapter)
        parameters = hf_target_parameters(layers, hf_adapter)
        config = adapter_config(cfg, targets, base_model_name_or_path, fused, parameters)
        (partial / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        replace_folder(partial, path)
        logger.info("saved LoRA adapter (PEFT layout, %d layers) to %s", len(layers), path)
    if dist.is_initialized():
        dist.barrier()
    return path
