"""The one model builder: spec -> args -> meta model -> converters -> pipeline split -> parallelize -> materialize.

The trainer, the dry run, the conversion tool and objectives that need an extra frozen model (a DPO
reference) all build through here, so every model of a job is sharded by the same plan and starts from
the same weights.

Initialization is layout-independent: every module draws from a generator seeded by the run seed and its
own name (``Decoder.init_weights``). A model whose parameters are plain tensors (one process, or pipeline
stages without sharding) initializes in place; a sharded one initializes a full copy of one block at a
time on its device and keeps its shard of it. Either way every layout starts from exactly the weights one
process would, on CPU and GPU alike, and a seed checkpoint can be written by the sharded job itself.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titanium.checkpoint.hf import (
    INDEX_FILE,
    SINGLE_FILE,
    HFCheckpoint,
    hf_model_args,
    load_hf_weights,
    read_hf_config,
    require_hf_adapter,
)
from titanium.checkpoint.manager import load_model_weights
from titanium.checkpoint.states import ModelState
from titanium.config.loader import ConfigError
from titanium.config.sections import CheckpointSection, ModelSection
from titanium.hooks import TrainingHooks
from titanium.models import build_model_args, get_model_spec, hf_family, list_models
from titanium.models.common.attention_kernels import AttentionBackend
from titanium.models.common.decoder import Decoder
from titanium.models.converter import ModelConverter, apply_converters, set_trainable, unconverted
from titanium.models.spec import ModelSpec
from titanium.models.transformers import BACKEND
from titanium.parallel.dims import Meshes, ParallelDims
from titanium.parallel.parallelize import PlanConfig, parallelize_decoder
from titanium.parallel.params import clean_fqn, copy_full_into
from titanium.parallel.pipeline import Pipeline, build_pipeline, keep_only

logger = logging.getLogger("titanium")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
DEFAULT_FAMILY = "llama3"
"""The family of ``--model.name auto`` when no Hugging Face config.json gives one."""


@dataclass(frozen=True)
class WeightSource:
    """Where the starting weights come from after the seeded initialization (at most one)."""

    hf_folder: str | None = None
    """A Hugging Face safetensors folder."""
    dcp_folder: str | None = None
    """A titanium checkpoint folder (``step-N``); only its model weights are read."""
    option: str = "--checkpoint.initial_load_path"
    """The setting that named the folder (``--kd.teacher_path``, a tool's argument): errors name it."""

    def fingerprint(self) -> str:
        """The folder with the name, size and modification time of each of its files ("" for none): it
        changes when the weights do, without reading them."""
        folder = self.hf_folder or self.dcp_folder
        if folder is None:
            return ""
        files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
        stats = [f"{p.relative_to(folder)} {p.stat().st_size} {p.stat().st_mtime_ns}" for p in files]
        return "\n".join([str(Path(folder).resolve()), *stats])


@dataclass(frozen=True)
class ModelSource:
    """A model to build: its family, args and the weights it starts from."""

    spec: ModelSpec
    args: Any
    weights: WeightSource = WeightSource()


@dataclass
class BuiltModel:
    """A model as built for this rank."""

    spec: ModelSpec
    args: Any
    model: nn.Module
    """This rank's parameters under their one-process names (under PP, the container of its stages)."""
    parts: list[nn.Module]
    """What runs: the model itself, or this rank's pipeline stages."""
    pipeline: Pipeline | None = None
    converters: list[ModelConverter] = field(default_factory=list)
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    """The context the forward runs in: mixed precision where FSDP does not apply it."""

    @property
    def frozen_base(self) -> bool:
        """A converter froze the original weights (LoRA): checkpoints hold only what trains, and the base is read
        from where the run started on every start, resumed or not."""
        return any(c.freezes_base for c in self.converters)

    def checkpoint_states(self) -> tuple[ModelState, ModelState | None]:
        """What a checkpoint holds of the model, and the part read from where the run started instead (the frozen
        base), if any."""
        whole = self.pipeline is None  # (a pipeline rank's stages hold some of the layers)
        if self.frozen_base:
            return ModelState(self.model, "trainable", whole), ModelState(self.model, "base", whole)
        return ModelState(self.model, whole=whole), None

    @property
    def pp_group(self) -> Any:
        """The pipeline's process group when stages are spread over ranks (exports gather over it), else None."""
        return self.pipeline.pp_group if self.pipeline is not None else None


@dataclass
class FrozenModel:
    """A model run without gradients on keyword inputs: its logits (float32, full vocabulary), or None on
    pipeline ranks without the last stage."""

    built: BuiltModel
    context: Callable[[], contextlib.AbstractContextManager]

    @torch.no_grad()
    def __call__(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        built = self.built
        with self.context(), built.autocast():
            out = built.pipeline.forward(inputs) if built.pipeline is not None else built.model(**inputs)
        return out.full_tensor() if isinstance(out, DTensor) else out

    @torch.no_grad()
    def hidden(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Its final (normed) hidden states ``[rows, seq, dim]``, not projected, whole (under sequence parallelism
        gathered from the tensor-parallel ranks), for losses that project chunk by chunk (distillation). Not under
        pipeline parallelism (use the logits there)."""
        built = self.built
        assert built.pipeline is None, "hidden states of a pipelined model are not supported"
        with self.context(), built.autocast():
            out = built.model(**inputs, project=False)
        return out.full_tensor() if isinstance(out, DTensor) else out

    def projection(self) -> tuple[torch.Tensor, float | None]:
        """Its output projection's weight ``[vocab, dim]``, whole (gathered once under FSDP: a copy of its own),
        and the final logit soft-cap, if any."""
        output = self.built.model.output
        weight = output.weight
        weight = weight.full_tensor() if isinstance(weight, DTensor) else weight.detach().clone()
        return weight, getattr(output, "logit_softcap", None)


def config_folder(model: ModelSection, hf_folder: str | os.PathLike | None = None) -> str | None:
    """The Hugging Face folder whose config.json the model is built from: ``hf_folder`` (the folder the weights
    start from), else ``[model] hf_config`` (a folder, or its config.json), else None (a flavor)."""
    if hf_folder is not None:
        return str(hf_folder)
    if not model.hf_config:
        return None
    path = Path(model.hf_config)
    return str(path.parent if path.name == "config.json" else path)


def resolve_spec(model: ModelSection, folder: str | os.PathLike | None) -> tuple[ModelSpec, str]:
    """The spec that builds ``[model]`` (a native family or the transformers backend), and why: the one place the
    trainer, the preflight checks, the dry run and the tools decide it. ``folder``: the Hugging Face folder whose
    config.json the model is built from (``config_folder``), or None."""
    backend, name = model.backend, model.name
    if name == BACKEND or backend == "transformers":
        if name not in ("auto", BACKEND):
            raise ConfigError(
                f"--model.backend transformers builds the model with transformers' code, not the family "
                f"--model.name {name}: leave --model.name out (or use --model.backend native)"
            )
        if folder is None:
            raise ConfigError(
                "the transformers backend builds a model from a Hugging Face config.json: start from a folder "
                "(--checkpoint.initial_load_path FOLDER --checkpoint.initial_load_in_hf) or name one with "
                "--model.hf_config FOLDER"
            )
        spec = image_text_names(get_model_spec(BACKEND), folder)
        checkpoints = spec.hf_adapter.for_config(read_hf_config(folder))
        spec = dataclasses.replace(spec, hf_adapter=checkpoints)
        if model.trust_remote_code:
            spec = dataclasses.replace(spec, hf_adapter=spec.hf_adapter.with_code_from(str(folder)))
        why = "--model.backend transformers" if backend == "transformers" else "--model.name transformers"
        return spec, f"{why}: transformers' {_architecture(folder)} from {Path(folder) / 'config.json'}"
    if name != "auto":
        if name not in list_models():
            raise ConfigError(f"--model.name {name!r} is not a known model; known models: {', '.join(list_models())}")
        return get_model_spec(name), f"--model.name {name}"
    if folder is None:
        return get_model_spec(DEFAULT_FAMILY), f"the default family, flavor {model.flavor} (no config.json to read)"
    model_type = read_hf_config(folder).get("model_type")
    family = hf_family(model_type)
    source = Path(folder) / "config.json"
    if family is not None:
        return get_model_spec(family), f"the native family that reads model_type {model_type!r} of {source}"
    if backend == "native":
        raise ConfigError(
            f"--model.backend native: no titanium family reads model_type {model_type!r} of {source} (families: "
            f"{', '.join(n for n in list_models() if n != BACKEND)}); use --model.backend auto or transformers"
        )
    return resolve_spec(dataclasses.replace(model, backend="transformers"), folder)[0], (
        f"no native family reads model_type {model_type!r} of {source}: transformers' {_architecture(folder)}"
    )


def image_text_names(spec: ModelSpec, folder: str | os.PathLike) -> ModelSpec:
    """The backend's ``spec`` with its adapter naming an image-text model's parts (language model, vision tower) as
    the folder's checkpoint does (``titanium.models.transformers.vision.checkpoint_prefixes``); unchanged for a text
    model."""
    from titanium.models.transformers import TransformersArgs
    from titanium.models.transformers.args import is_image_text
    from titanium.models.transformers.vision import checkpoint_prefixes, module_prefixes

    config = read_hf_config(folder)
    if not is_image_text(config):
        return spec
    args = TransformersArgs.from_config(config)
    weights = any((Path(folder) / name).is_file() for name in (INDEX_FILE, SINGLE_FILE))
    keys = HFCheckpoint.open(folder).shapes if weights else ()
    adapter = spec.hf_adapter.with_prefixes(checkpoint_prefixes(args, keys), module_prefixes(args))
    return dataclasses.replace(spec, hf_adapter=adapter)


def _architecture(folder: str | os.PathLike) -> str:
    """The model class config.json names (else the one ``transformers`` maps its model_type to)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    config = read_hf_config(folder)
    model_type = config.get("model_type")
    named = next(iter(config.get("architectures") or []), None)
    named = named or MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type)
    named = named or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return named or f"model_type {model_type!r}"


@dataclass
class ModelBuilder:
    """Builds models for one job: the parallel plan (None: one process, no parallelism), device and seed."""

    device: torch.device
    seed: int = 0
    dims: ParallelDims | None = None
    meshes: Meshes | None = None
    plan: PlanConfig | None = None
    attention: AttentionBackend = "auto"
    """Kernel for masked attention ([model] attention)."""

    def __post_init__(self) -> None:
        if self.attention == "flex" and self.device.type == "cpu":
            raise ConfigError("--model.attention flex: FlexAttention has no backward on CPU; use auto or sdpa")

    # ----- 1. spec and args -----

    def resolve(
        self,
        model: ModelSection,
        *,
        seq_len: int,
        vocab_size: int | None = None,
        checkpoint: CheckpointSection | None = None,
        hf_folder: str | os.PathLike | None = None,
        hf_option: str | None = None,
        family_option: str = "--model.name",
        tokenizer_origin: str | os.PathLike | None = None,
    ) -> tuple[ModelSpec, Any]:
        """The family spec and args of ``[model]``, with ``seq_len`` as RoPE length.

        When the model is built from a Hugging Face config.json (``hf_folder``, named by the setting ``hf_option``, or
        the ``[checkpoint]`` start folder with ``initial_load_in_hf``, or ``[model] hf_config``), that file gives the
        family or backend (``resolve_spec``), the architecture and the vocabulary (which ``vocab_size``, the
        tokenizer's, read from ``tokenizer_origin``, must fit); otherwise the flavor does, with ``vocab_size`` (None:
        the flavor's). ``family_option``: the setting that picks the family (a tool's own flag), for the error on a
        folder of another family."""
        if checkpoint is not None and hf_folder is None and checkpoint.initial_load_in_hf:
            hf_folder, hf_option = checkpoint.initial_load_path, "--checkpoint.initial_load_path"
        folder = config_folder(model, hf_folder)
        if folder is not None and hf_folder is None:
            hf_option = "--model.hf_config"
        spec, why = resolve_spec(model, folder)
        logger.info("model: %s (%s)", spec.name, why)
        if checkpoint is not None:
            require_hf_adapter(spec, checkpoint)
        if folder is not None:
            args = hf_model_args(
                spec,
                folder,
                tokenizer_vocab=vocab_size,
                tokenizer_origin=tokenizer_origin,
                option=hf_option,
                family_option=family_option,
                max_seq_len=seq_len,
            )
            self._note_flavor(spec, model.flavor, folder)
            described = f"{spec.name} from {Path(folder) / 'config.json'}"
        else:
            overrides: dict[str, Any] = {"max_seq_len": seq_len}
            if vocab_size is not None:
                overrides["vocab_size"] = vocab_size
            args = build_model_args(spec, model.flavor, **overrides)
            described = f"{spec.name} {model.flavor}"
        if self.dims is not None:
            self.dims.check_model(args.decoder_args(), model=described, seq_len=seq_len)
        return spec, args

    @staticmethod
    def _note_flavor(spec: ModelSpec, flavor: str, folder: str | os.PathLike) -> None:
        """Say so when ``--model.flavor`` names another shape than the checkpoint's (the checkpoint wins)."""
        preset = spec.flavors.get(flavor)
        if preset is None or spec.hf_adapter is None:
            return
        differences = spec.hf_adapter.differences(read_hf_config(folder), preset)
        if differences:
            logger.info(
                "model shape from %s, not --model.flavor %s (%s)",
                Path(folder) / "config.json",
                flavor,
                "; ".join(differences),
            )

    # ----- 2. build -----

    def build(
        self,
        spec: ModelSpec,
        args: Any,
        *,
        converters: list[ModelConverter] | None = None,
        weights: WeightSource | None = None,
        materialize: bool = True,
    ) -> BuiltModel:
        """Build, convert, split, parallelize and (unless ``materialize=False``: a dry run) materialize."""
        converters = list(converters or [])
        with torch.device("meta"):
            model = spec.model_cls(args)
        model.attention_backend = self.attention
        logger.info("model %s: %.2fM parameters", spec.name, sum(p.numel() for p in model.parameters()) / 1e6)
        apply_converters(converters, model)
        weights = weights or WeightSource()
        if materialize and any(c.materialize_before_parallelize for c in converters):
            # Converters that need whole tensors (QLoRA's NF4) see the model fully built first.
            built = BuiltModel(spec, args, model, [model], converters=converters)
            self._init_in_place(built)
            self._load(built, weights)
            self._after_materialize(built)
            self._parallelize(built)
        else:
            one_process_model = copy.deepcopy(model)  # on meta: free; the template of the sharded init
            built = BuiltModel(spec, args, model, [model], converters=converters)
            self._parallelize(built)
            if materialize:
                self._materialize(built, one_process_model)
                self._load(built, weights)
                self._after_materialize(built)
        set_trainable(converters, built.model)
        built.autocast = self._autocast
        built.model.train()
        return built

    def load_hf(
        self,
        spec: ModelSpec,
        folder: str | os.PathLike,
        *,
        option: str | None = None,
        family_option: str | None = None,
        **overrides: Any,
    ) -> BuiltModel:
        """A model with the architecture of a Hugging Face folder's config.json and its weights
        (``overrides`` replace args, e.g. ``max_seq_len``; ``option``, ``family_option``: as ``hf_model_args``'s)."""
        args = hf_model_args(spec, folder, option=option, family_option=family_option, **overrides)
        return self.build(spec, args, weights=WeightSource(hf_folder=str(folder), option=option or str(folder)))

    def frozen_copy(
        self,
        spec: ModelSpec,
        args: Any,
        weights: WeightSource,
        *,
        converters: list[ModelConverter],
        batch_size: int,
    ) -> FrozenModel:
        """A no-grad model of its own, built by the same plan with ``converters`` from ``weights``."""
        built = self.build(spec, args, converters=converters, weights=weights)
        for p in built.model.parameters():
            p.requires_grad_(False)
        return FrozenModel(self.scheduled(built, batch_size), contextlib.nullcontext)

    def switched_off(self, policy: BuiltModel, converters: list[ModelConverter], *, batch_size: int) -> FrozenModel:
        """``policy``'s own modules run without gradients and with ``converters`` switched off in place (each must
        offer ``without_conversion``): no second copy."""
        return FrozenModel(self.scheduled(policy, batch_size), lambda: unconverted(converters, policy.model))

    def scheduled(
        self,
        built: BuiltModel,
        batch_size: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> BuiltModel:
        """``built``'s own modules with a pipeline schedule of their own over its stages, if it has any: forward only
        without ``loss_fn``, else forward and backward with it as the last stage's loss (``Pipeline.build_schedule``),
        ``batch_size`` rows a step."""
        if built.pipeline is None or self.plan is None:
            return built
        pipeline = dataclasses.replace(built.pipeline, schedule=None)
        pipeline.build_schedule(self.plan.parallelism, batch_size, self.device, loss_fn=loss_fn)
        return dataclasses.replace(built, pipeline=pipeline)

    def register_hooks(self, built: BuiltModel, hooks: TrainingHooks) -> None:
        """``built``'s hooks on the loop (the policy's): its converters'."""
        for converter in built.converters:
            hooks.after_optimizer_step.register(lambda step, c=converter: c.after_optimizer_step(built.parts))
            hooks.export.register(lambda ctx, c=converter: c.export(built.model, ctx))

    def _parallelize(self, built: BuiltModel) -> None:
        """Pipeline split, then per stage TP -> CP -> AC -> compile -> FSDP (nothing without a plan)."""
        if self.plan is None or self.dims is None or self.meshes is None:
            return
        dims, meshes, plan = self.dims, self.meshes, self.plan

        def parallelize(part: nn.Module) -> None:
            parallelize_decoder(part, dims, meshes, plan, tp_plan=built.spec.tp_plan)

        if dims.pp > 1:
            built.pipeline = build_pipeline(built.model, meshes.pp, plan.parallelism, parallelize)
            built.model, built.parts = built.pipeline.model, built.pipeline.parts
        else:
            parallelize(built.model)

    def _init_in_place(self, built: BuiltModel) -> None:
        for part in built.parts:  # (pipeline stages: each parameter is in exactly one part)
            part.to_empty(device=self.device)
            part.init_weights(buffer_device=self.device, seed=self.seed)

    def _materialize(self, built: BuiltModel, one_process_model: Decoder) -> None:
        """Allocate and initialize: in place for plain tensors; for sharded ones, one block at a time in
        full on this device, keeping this rank's shard (the values one process would draw)."""
        if not any(isinstance(p, DTensor) for p in built.model.parameters()):
            self._init_in_place(built)
            return
        for part in built.parts:
            part.to_empty(device=self.device)
            part.init_buffers(self.device)
        params = {clean_fqn(name): p for name, p in built.model.named_parameters()}
        buffers = {clean_fqn(name): b for name, b in built.model.named_buffers()}
        units = [([key], False, False) for key in one_process_model.layers] + [([], True, True)]
        for layers, first, last in units:
            unit = keep_only(one_process_model, layers, first, last)
            names = [name for name, _ in unit.named_parameters() if name in params]
            if not names:
                continue  # another pipeline stage's
            unit.to_empty(device=self.device)
            unit.init_weights(buffer_device=self.device, seed=self.seed)
            full = dict(unit.named_parameters())
            for name in names:
                copy_full_into(params[name], full[name])
            with torch.no_grad():  # the blocks' buffers (an MoE's routing bias and counts; never sharded)
                for name, value in unit.named_buffers():
                    if name.startswith("layers.") and name in buffers:
                        buffers[name].copy_(value)

    def _load(self, built: BuiltModel, weights: WeightSource) -> None:
        if weights.hf_folder is not None:
            if built.spec.hf_adapter is None:
                raise ConfigError(f"model {built.spec.name!r} has no Hugging Face adapter")
            whole = None
            if built.pipeline is not None:  # this rank holds some stages: check the file against the whole model
                with torch.device("meta"):
                    whole = {k: tuple(v.shape) for k, v in built.spec.model_cls(built.args).state_dict().items()}
            load_hf_weights(built.model, weights.hf_folder, built.spec.hf_adapter, built.args, whole, weights.option)
        elif weights.dcp_folder is not None:
            load_model_weights(Path(weights.dcp_folder), built.model, weights.option)
            logger.info("loaded model weights from %s", weights.dcp_folder)

    def _after_materialize(self, built: BuiltModel) -> None:
        for converter in built.converters:
            converter.after_materialize(built.model, self.seed)

    def _autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision for layouts FSDP does not cover (one device, TP-only, PP-only): autocast to the
        configured param dtype; FSDP casts the parameters itself."""
        plan = self.plan
        dtype = plan.param_dtype if plan is not None else torch.float32
        if dtype == torch.float32 or (self.dims is not None and self.dims.fsdp_enabled):
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)
