"""Image-text-to-text models (Qwen2.5-VL, Qwen3-VL, Llama 3.2 Vision, Gemma 3, Llama 4) through the backend.

``transformers`` builds the whole ``*ForConditionalGeneration`` on meta. Its language model goes behind the shared
decoder's interface as ``TransformersModel`` puts any causal LM there (``tok_embeddings``, ``layers``, ``norm``,
``output``), so FSDP units, activation checkpointing, compile, LoRA and the export treat it as a text model. The
vision tower and the projector (and any other module outside the language model) become further children under their
own ``transformers`` names (``visual``, ``vision_model``, ``multi_modal_projector``...): FSDP shards them with the
root, tensor parallelism computes them whole on every rank beside the split language model (``parallelize.py``),
LoRA reaches them only when asked. Context and pipeline parallelism are refused (``image_text_refusals``).

A microbatch's images (``titanium.batch.ImageInputs``, the processor's tensors per row) enter the forward as
``images``; how each architecture reads them is its feed (``image_feeds.py``): the placeholder tokens' embeddings
replaced by the projected image features (early fusion), 3-D rotary positions (Qwen's M-RoPE), bidirectional
image blocks (Gemma 3), or cross-attention states (Llama 3.2 Vision). The language model's attention is titanium's;
the vision tower keeps its own (SDPA), as it attends within an image.

Checkpoints: the module names of the model in memory (what ``save_pretrained`` writes and PEFT adapters name), or,
for a folder in the published checkpoints' older layout (Qwen2.5-VL's ``visual.*`` and ``model.layers.*``), that
layout, read through ``transformers``' own renaming rules so an export keeps the source's names (``hf.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from titanium.models.hf_adapter import HFConfigError
from titanium.models.transformers.args import TransformersArgs
from titanium.models.transformers.attention import ATTENTION, register_titanium_attention
from titanium.models.transformers.language import language_model
from titanium.models.transformers.model import HEAD, TransformersModel
from titanium.models.transformers.support import fallback_reasons, own_attention


def build_image_text_model(args: TransformersArgs) -> tuple[nn.Module, list[str]]:
    """``AutoModelForImageTextToText.from_config`` of ``args`` in float32 on the current device: titanium's attention
    in the language model where it can serve it (else the model's own), the vision tower's own (SDPA)."""
    from transformers import AutoModelForImageTextToText

    register_titanium_attention()
    config = copy.deepcopy(args.hf_config)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    reasons = fallback_reasons(model, config.get_text_config())
    text = own_attention(model) if reasons else ATTENTION
    model.set_attn_implementation({"": text, "text_config": text, "vision_config": own_attention(model)})
    return model, reasons


def vision_parts(hf: nn.Module, keep: Collection[nn.Module]) -> dict[str, tuple[nn.Module, nn.Module]]:
    """The modules of ``hf`` outside ``keep`` (its language model and head) that hold parameters: the vision tower,
    the projector... as {their attribute name: (the module, the module holding it)}, found by descending only into
    the modules that hold one of ``keep``."""
    kept = {id(m) for m in keep}
    holders = {id(m) for k in keep for m in hf.modules() if any(id(c) == id(k) for c in m.modules())}
    parts: dict[str, tuple[nn.Module, nn.Module]] = {}

    def visit(container: nn.Module) -> None:
        for name, child in container.named_children():
            if id(child) in kept:
                continue
            if id(child) in holders:
                visit(child)
            elif next(child.parameters(), None) is not None:
                if name in parts:
                    raise HFConfigError(f"two modules of {type(hf).__name__} are called {name!r}")
                parts[name] = (child, container)

    visit(hf)
    return parts


class ImageTextModel(TransformersModel):
    """A ``transformers`` image-text-to-text model: ``TransformersModel``'s language model plus its vision parts,
    reading ``images`` (``titanium.batch.ImageInputs``) through its feed (module docstring)."""

    def _build_hf(self, args: TransformersArgs) -> tuple[nn.Module, list[str]]:
        return build_image_text_model(args)

    def _language_parts(self, hf: nn.Module) -> tuple[nn.Module, nn.Module]:
        from titanium.models.transformers.image_feeds import image_feed

        self.feed = image_feed(self.args.model_type, hf)
        base, head = language_model(hf), hf.get_output_embeddings()
        if head is None:
            raise HFConfigError(f"transformers' {type(hf).__name__} has no output embeddings ({HEAD})")
        parts = vision_parts(hf, (base, head))
        taken = set(self.BASE_NAMES) | {
            name for name in base._modules if name not in ("embed_tokens", "layers", "norm")
        }
        clash = sorted(taken & set(parts))
        if clash:
            raise HFConfigError(f"{type(hf).__name__}'s {', '.join(clash)} would shadow the language model's parts")
        self.vision_names: tuple[str, ...] = tuple(parts)
        """The children that are not the language model (vision tower, projector): in FSDP's root unit, computed
        whole on every tensor-parallel rank (pipeline parallelism is refused: ``image_text_refusals``)."""
        for name, (module, _) in parts.items():
            setattr(self, name, module)
        holders = [m for m in hf.modules() if any(c is base or c is head for c in m.modules()) and m is not base]
        holders = list({id(m): m for m in [*holders, *(home for _, home in parts.values())]}.values())
        ours = {id(base): "_base", id(head): "output", **{id(module): name for name, (module, _) in parts.items()}}
        self._links = [
            (holder, attribute, ours.get(id(child), child))
            for holder in holders
            for attribute, child in holder.named_children()
        ]
        """(holder, attribute, our attribute name or the module itself): what ``_install`` hands back to the
        ``transformers`` modules that held the parts, whose ``_modules`` are emptied (as the base model's)."""
        for holder in holders:
            holder._modules.clear()
        for module in base.modules():  # cross-attention layers take the model's own masks (attention.py)
            if "CrossAttention" in type(module).__name__:
                module.is_causal = False
        return base, head

    def _install(self) -> None:
        super()._install()
        for holder, attribute, value in self._links:
            holder.__dict__[attribute] = getattr(self, value) if isinstance(value, str) else value

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: Any = None,
        project: bool = True,
        parent_ids: torch.Tensor | None = None,
        images: Any = None,
    ) -> torch.Tensor:
        """``TransformersModel.forward`` with the rows' ``images`` (``ImageInputs``; None: text only)."""
        if images is None and not self.feed.remembers(kv_cache):
            return super().forward(tokens, positions, document_ids, kv_cache, project, parent_ids)
        self._install()
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        positions = positions if positions.dim() == 2 else positions.unsqueeze(0).expand(tokens.shape[0], -1)
        ids = tokens if self.tok_embeddings is not None else None
        fed = self.feed.prepare(self, ids, positions, document_ids, parent_ids, images, kv_cache)
        inputs = {"inputs_embeds": fed.embeddings if ids is not None else tokens}
        return self._run_language_model(
            inputs,
            positions,
            document_ids,
            parent_ids,
            kv_cache,
            project,
            rope=fed.rope,
            blocks=fed.blocks,
            **fed.kwargs,
        )


# ----- checkpoint names -----


def module_prefixes(args: TransformersArgs) -> tuple[tuple[str, str], ...]:
    """Our names' prefixes -> the ``transformers`` model's module paths (what ``save_pretrained`` writes and PEFT
    names), most specific first."""
    return _module_prefixes(args.config_json)


@lru_cache(maxsize=8)
def _module_prefixes(config_json: str) -> tuple[tuple[str, str], ...]:
    args = TransformersArgs(config_json=config_json)
    with torch.device("meta"):
        hf, _ = build_image_text_model(args)
    paths = {id(m): name for name, m in hf.named_modules()}
    base, head = language_model(hf), hf.get_output_embeddings()
    lm = paths[id(base)]
    prefixes = [
        ("tok_embeddings.", f"{lm}.embed_tokens."),
        ("norm.", f"{lm}.norm."),
        ("output.", f"{paths[id(head)]}."),
    ]
    prefixes += [(f"{name}.", f"{paths[id(module)]}.") for name, (module, _) in vision_parts(hf, (base, head)).items()]
    return (*prefixes, ("", f"{lm}."))


def checkpoint_prefixes(args: TransformersArgs, keys: Collection[str]) -> tuple[tuple[str, str], ...]:
    """The prefixes of a checkpoint holding ``keys``: the module paths (``module_prefixes``), or, where its keys are
    in an older layout that ``transformers`` renames on loading (``^visual`` -> ``model.visual``...), that layout's,
    found by renaming each key with ``transformers``' own rules for the model."""
    modules = module_prefixes(args)
    renamed = _renamed(args.config_json, tuple(sorted(keys)))
    if all(old == new for old, new in renamed.items()):
        return modules
    found: dict[str, set[str]] = {}
    for old, new in renamed.items():
        ours, module_prefix = next((o, p) for o, p in modules if new.startswith(p))
        rest = new[len(module_prefix) :]
        if not old.endswith(rest):
            raise HFConfigError(f"checkpoint key {old!r} is renamed by transformers to {new!r}: not a prefix change")
        found.setdefault(ours, set()).add(old[: len(old) - len(rest)])
    layout = []
    for ours, module_prefix in modules:
        olds = found.get(ours, {module_prefix})
        if len(olds) > 1:
            raise HFConfigError(f"the checkpoint names {ours or 'the language model'} in several ways: {sorted(olds)}")
        layout.append((ours, olds.pop()))
    return tuple(layout)


@lru_cache(maxsize=8)
def _renamed(config_json: str, keys: tuple[str, ...]) -> dict[str, str]:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, apply_renamings

    args = TransformersArgs(config_json=config_json)
    with torch.device("meta"):
        hf, _ = build_image_text_model(args)
    renamings = [t for t in get_model_conversion_mapping(hf, add_legacy=False) if isinstance(t, WeightRenaming)]
    return {key: apply_renamings(key, renamings) for key in keys}


def image_text_refusals(args: TransformersArgs, model: ImageTextModel, use: Any) -> list[str]:
    """What an image-text model cannot do of ``use`` (a ``ModelUse``), as messages naming the flag to change.
    Tensor parallelism is the language model's plan (``checks.py`` refuses a model without a plan titanium
    translates: Llama 3.2 Vision has none, Qwen3-VL's splits no layer, Llama 4's splits its MoE experts), the vision
    parts computed whole on every rank (``parallelize.WholeOnPlainTensors``)."""
    problems = []
    if use.context_parallel > 1:
        problems.append(
            f"--parallelism.context_parallel_degree {use.context_parallel}: splitting a row's tokens over ranks is not "
            "made exact for image tokens (their features, M-RoPE positions and image blocks); use FSDP instead"
        )
    if use.pipeline_parallel > 1:
        problems.append(
            f"--parallelism.pipeline_parallel_degree {use.pipeline_parallel}: an image-text model's vision tower and "
            "image inputs are not split into pipeline stages yet; use FSDP and tensor parallelism (its language "
            "model) instead"
        )
    if use.packing and (use.packing != "--sft.packing" or args.model_type not in PACKED_IMAGES):
        problems.append(packing_problem(use.packing, args.model_type))
    return problems


PACKED_IMAGES = frozenset({"gemma3", "qwen2_5_vl", "qwen3_vl"})
"""Architectures whose SFT samples pack with their images, exactly (``tests/unit/test_vision_packing.py``: the packed
loss and gradients equal one sample a row's): early fusion, each sample's positions restarting (Qwen's M-RoPE
computed per document by ``image_feeds.QwenFeed``), attention masked per document with Gemma 3's image blocks in it."""


def packing_problem(flag: str, model_type: str) -> str:
    """Why ``flag`` (``--sft.packing``, ``--dpo.packing``...) is refused for an image-text ``model_type``."""
    section, key = flag.removeprefix("--").split(".", 1)
    off = f"set --{section}.no_{key}"
    if flag != "--sft.packing":
        return (
            f"{flag}: packing several samples with images into one row is built for SFT only (--sft.packing on "
            f"{', '.join(sorted(PACKED_IMAGES))}); {off}"
        )
    if model_type == "mllama":
        why = (
            "Llama 3.2 Vision's text reads the images through cross-attention over a row's image tiles (a per-token "
            "mask over the row's images, a row of tiles per image), which is not made exact for several samples in "
            "a row"
        )
    else:
        why = f"packing {model_type}'s samples with their images is not checked exact (its positions and image inputs)"
    return f"{flag}: {why}; {off} (packs with images: {', '.join(sorted(PACKED_IMAGES))})"


def build_transformers_model(args: TransformersArgs) -> TransformersModel:
    """The backend's model of ``args``: an ``ImageTextModel`` for an image-text-to-text config, else a
    ``TransformersModel``."""
    return ImageTextModel(args) if args.reads_images else TransformersModel(args)
