"""A LoRA run's DCP checkpoint rebuilt as the model that run trained, for the conversion tool.

Such a checkpoint holds only the adapters (the base is frozen and read from where the run started, on every
start), so the model is rebuilt from the run's saved ``config.toml`` the way the trainer builds it: the same
family args (the Hugging Face start folder's config.json, or the flavor with the tokenizer's vocabulary), the
same converters ([lora] rank, alpha, targets, DoRA, rsLoRA, NF4), the base from ``[checkpoint]
initial_load_path`` (or the seeded initialization of ``[debug] seed``), and then the checkpoint's adapters.
The result exports exactly as the run's own end-of-training exports would.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titanium.checkpoint.manager import load_model_weights
from titanium.config import load_config
from titanium.config.components import OBJECTIVES
from titanium.data.tokenizer import build_tokenizer, tokenizer_origin
from titanium.errors import UserError
from titanium.model_builder import BuiltModel, ModelBuilder, WeightSource
from titanium.model_setup import StartingWeights, job_converters
from titanium.parallel.dims import ParallelDims

CONFIG_FILE = "config.toml"
"""The resolved config a run writes to its job.dump_folder, two levels above its ``checkpoint/step-N`` folders."""


@dataclass
class LoRARun:
    cfg: Any
    """The run's job config, as saved beside its checkpoints."""
    built: BuiltModel
    """The model with the run's base and the checkpoint's adapters, on CPU."""
    tokenizer: Any
    """The run's tokenizer (exports carry it)."""

    @property
    def base_model_name_or_path(self) -> str | None:
        """The Hugging Face folder the run started from, if any (a PEFT adapter's ``base_model_name_or_path``)."""
        ck = self.cfg.checkpoint
        return ck.initial_load_path if ck.initial_load_in_hf else None


def run_config_path(checkpoint: Path, config: Path | None) -> Path:
    """``config``, or the ``config.toml`` of the run that wrote ``checkpoint`` (``<dump_folder>/checkpoint/step-N``)."""
    path = config if config is not None else checkpoint.resolve().parent.parent / CONFIG_FILE
    if not path.is_file():
        raise UserError(
            f"{checkpoint} is a LoRA run's checkpoint: it holds the adapters only, and the base model and [lora] "
            f"settings come from the run's {CONFIG_FILE}, which is not at {path}; pass --config (the run's "
            f"job.dump_folder/{CONFIG_FILE})"
        )
    return path


def load_lora_run(checkpoint: Path, config: Path | None = None) -> LoRARun:
    """The model that the LoRA run saved in ``checkpoint`` (a ``step-N`` folder) computes, built from the run's
    config (``config``, default: the run's own ``config.toml``). Bad input raises ``UserError``."""
    cfg = load_config(["--job.config_file", str(run_config_path(checkpoint, config))])
    if cfg.lora.rank == 0:
        raise UserError(f"{config or CONFIG_FILE}: [lora] rank is 0, but {checkpoint} holds LoRA adapters")
    builder = ModelBuilder(torch.device("cpu"), cfg.debug.seed)
    built = build_checkpoint_model(checkpoint, cfg, builder, ParallelDims(dp_replicate=1, dp_shard=1, world_size=1))
    built.model.eval()
    return LoRARun(cfg, built, build_tokenizer(cfg.tokenizer))


def build_checkpoint_model(checkpoint: Path, cfg: Any, builder: ModelBuilder, dims: ParallelDims) -> BuiltModel:
    """The model a run (job config ``cfg``) saved in ``checkpoint``, built by ``builder`` (its plan, ``dims``) as the
    trainer built it: its family args, converters and, where a converter froze the base (LoRA: the checkpoint holds
    only the adapters), the base from where the run started, then the checkpoint's weights."""
    tokenizer = build_tokenizer(cfg.tokenizer)
    spec, args = builder.resolve(
        cfg.model,
        seq_len=cfg.training.seq_len,
        vocab_size=tokenizer.vocab_size,
        checkpoint=cfg.checkpoint,
        tokenizer_origin=tokenizer_origin(cfg.tokenizer),
    )
    ck = cfg.checkpoint
    spec = OBJECTIVES.load(cfg.training.objective).policy_spec(
        spec, tokenizer, ck.initial_load_path if ck.initial_load_in_hf else None
    )
    converters = job_converters(cfg, dims, None)  # (no hardware checks: a float8 run's weights load on any device)
    if not any(c.freezes_base for c in converters):
        return builder.build(spec, args, converters=converters, weights=WeightSource(dcp_folder=str(checkpoint)))
    start = StartingWeights(ck, cfg.job.dump_folder).start()
    built = builder.build(spec, args, converters=converters, weights=WeightSource(hf_folder=start.hf_folder))
    if start.dcp_folder is not None:  # a titanium base: its frozen part, as the trainer's checkpoint manager reads it
        load_model_weights(Path(start.dcp_folder), built.model, "--checkpoint.initial_load_path", part="base")
    fix = (
        "the run config that builds the model must be the one of the run that wrote the checkpoint: its [lora] rank, "
        "target_modules and use_dora give the adapters (pass that run's --config)"
    )
    load_model_weights(checkpoint, built.model, "CHECKPOINT", part="trainable", fix=fix)
    return built
