"""A job's model setup, shared by the trainer and the dry run so the two cannot differ: the parallel plan, the
converters its config turns on, and where the weights start from."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titanium.checkpoint.manager import complete_steps
from titanium.config.components import CONVERTERS, check_reads_images
from titanium.config.errors import ConfigError
from titanium.config.sections import CheckpointSection, CompileSection, TrainingSection
from titanium.data.vision import ImageData, load_processor
from titanium.model_builder import DTYPES, WeightSource, config_folder, resolve_spec
from titanium.models.converter import ConverterContext, ModelConverter
from titanium.models.spec import ModelSpec
from titanium.parallel.dims import ParallelDims
from titanium.parallel.parallelize import PlanConfig
from titanium.precision import compute_dtype

logger = logging.getLogger("titanium")


def job_plan(
    cfg: Any, dims: ParallelDims, device_type: str, compile: CompileSection | None = None, announce: bool = False
) -> PlanConfig:
    """The parallel plan of the job config ``cfg`` on ``device_type`` (``compile`` replaces its [compile] section;
    ``announce``: log the compute dtype chosen, on one rank)."""
    t = cfg.training
    return PlanConfig(
        parallelism=cfg.parallelism,
        activation_checkpoint=cfg.activation_checkpoint,
        compile=compile or cfg.compile,
        param_dtype=compute_dtype(t.mixed_precision_param, device_type, announce=announce),
        reduce_dtype=DTYPES[t.mixed_precision_reduce],
        pipeline=dims.pp > 1,
    )


def job_model_spec(cfg: Any) -> ModelSpec:
    """The family or backend that builds the job's model, decided from its config.json where there is one (the
    Hugging Face start folder's, or ``[model] hf_config``; ``titanium.model_builder.resolve_spec``)."""
    ck = cfg.checkpoint
    start = ck.initial_load_path if ck.initial_load_in_hf else None
    return resolve_spec(cfg.model, config_folder(cfg.model, start))[0]


def job_converters(cfg: Any, dims: ParallelDims, device_type: str | None) -> list[ModelConverter]:
    """The registered converters (titanium/config/components.py) that their own sections of ``cfg`` turn on, in
    registration order; each sees only its section. ``device_type``: where the run computes (None: a dry run, no
    hardware checks). A section left at its defaults is off, and its converter is not even imported (torchao is
    slow to import)."""
    ctx = ConverterContext(
        shard_degree=dims.dp_shard * dims.cp,
        fsdp=dims.fsdp_enabled,
        device_type=device_type,
        hf_adapter=job_model_spec(cfg).hf_adapter,
    )
    converters = []
    for component in CONVERTERS:
        assert component.section is not None, f"converter {component.name} has no config section"
        section = getattr(cfg, component.section.name)
        if section == type(section)():
            continue
        converter = CONVERTERS.load(component.name).from_config(section, ctx)
        if converter is not None:
            converters.append(converter)
    return converters


def job_processor(cfg: Any, args: Any) -> ImageData | None:
    """What the objective reads rows beyond text through, for the model built from ``args``: an image-text model's
    processor (``AutoProcessor`` of the Hugging Face folder it is built from) with the ``[vision]`` options; None for
    a text model. ``ConfigError`` when the job's objective reads no images."""
    if not getattr(args, "reads_images", False):
        return None
    check_reads_images(cfg.training.objective)
    ck = cfg.checkpoint
    start = ck.initial_load_path if ck.initial_load_in_hf else None
    option = "--checkpoint.initial_load_path" if start is not None else "--model.hf_config"
    return ImageData(load_processor(config_folder(cfg.model, start), option), cfg.vision)


@dataclass(frozen=True)
class StartingWeights:
    """Where the policy's weights start from ([checkpoint] initial_load_path), for the policy and for models of the
    policy as it started (a reference, a frozen base)."""

    checkpoint: CheckpointSection
    dump_folder: str

    def policy(self, converters: list[ModelConverter]) -> WeightSource:
        """The Hugging Face folder to build the policy from, unless this run resumes its own checkpoint (loaded
        later, it wins). With a frozen base (LoRA) the checkpoints hold only what trains, so the base is always
        loaded. A titanium initial checkpoint is read by the checkpoint manager (with its other state)."""
        ck = self.checkpoint
        if not ck.initial_load_in_hf:
            return WeightSource()
        resuming = ck.enable and complete_steps(Path(self.dump_folder) / ck.folder)
        if resuming and not any(c.freezes_base for c in converters):
            logger.info("not loading %s: this run resumes from its own checkpoint", ck.initial_load_path)
            return WeightSource()
        return WeightSource(hf_folder=ck.initial_load_path)

    def loads_nothing(self) -> bool:
        """Whether the policy starts from its seeded initialization: no ``initial_load_path`` and no checkpoint of
        this run to resume."""
        ck = self.checkpoint
        return not ck.initial_load_path and not (ck.enable and complete_steps(Path(self.dump_folder) / ck.folder))

    def check_evaluate_only(self, training: TrainingSection) -> None:
        """``--training.steps 0`` evaluates the weights as loaded: with none to load it would score an untrained
        model and exit 0, so it is refused unless ``--training.evaluate_untrained`` asks for that baseline."""
        if training.steps == 0 and not training.evaluate_untrained and self.loads_nothing():
            enabled = f"; no checkpoint of this run in {Path(self.dump_folder) / self.checkpoint.folder}"
            raise ConfigError(
                "--training.steps 0 evaluates the weights as loaded, and this run loads none"
                + (enabled if self.checkpoint.enable else " (--checkpoint.enable is off)")
                + ": set --checkpoint.initial_load_path (a step-N folder, or a Hugging Face folder with "
                "--checkpoint.initial_load_in_hf), or --training.evaluate_untrained to score the initialization"
            )

    def start(self) -> WeightSource:
        """The starting policy's weights (also a frozen base's): a Hugging Face folder, a titanium checkpoint, or
        none (the seeded initialization)."""
        ck = self.checkpoint
        if ck.initial_load_path and not ck.initial_load_in_hf:
            return WeightSource(dcp_folder=ck.initial_load_path)
        return WeightSource(hf_folder=ck.initial_load_path) if ck.initial_load_in_hf else WeightSource()
