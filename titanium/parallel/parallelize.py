"""Apply a parallel plan to a decoder built on the meta device: TP -> EP -> CP -> AC -> compile -> FSDP.

The model family supplies only its tensor-parallel plan (``models/<family>/parallelize.py``); the
order of the steps and everything that is not model-specific lives here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from titanium.config.loader import ConfigError
from titanium.config.sections import ActivationCheckpointSection, CompileSection, ParallelismSection
from titanium.models.spec import TensorParallelPlan
from titanium.parallel.activation_checkpoint import apply_activation_checkpointing
from titanium.parallel.compile import apply_compile, check_compile, enable_async_tensor_parallel
from titanium.parallel.context import apply_context_parallel
from titanium.parallel.dims import Meshes, ParallelDims
from titanium.parallel.expert import apply_expert_parallel
from titanium.parallel.fsdp import apply_fsdp

logger = logging.getLogger("titanium")


@dataclass(frozen=True)
class PlanConfig:
    """The config sections the plan reads (never the whole job config)."""

    parallelism: ParallelismSection
    activation_checkpoint: ActivationCheckpointSection
    compile: CompileSection
    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    pipeline: bool = False
    """The model is one pipeline stage (changes the FSDP reshard default)."""


def parallelize_decoder(
    model: nn.Module,
    dims: ParallelDims,
    meshes: Meshes,
    cfg: PlanConfig,
    tp_plan: TensorParallelPlan | None = None,
) -> None:
    """Parallelize a decoder with a ``layers`` ModuleDict of blocks, in place."""
    check_compile(cfg.compile, cfg.activation_checkpoint, dims.tp_enabled, meshes.world.device_type)
    if dims.tp_enabled:
        if tp_plan is None:
            raise ConfigError(
                f"--parallelism.tensor_parallel_degree {dims.tp}: this model family has no tensor-parallel plan; use 1"
            )
        tp_plan(model, meshes.tp, dims.loss_parallel_enabled)
        if cfg.compile.enable_async_tensor_parallel:
            enable_async_tensor_parallel(meshes.tp)
    if dims.ep > 1:
        assert meshes.ep is not None
        apply_expert_parallel(model, meshes.ep)
    if dims.cp > 1:
        apply_context_parallel(model, meshes.cp)
    apply_activation_checkpointing(model, cfg.activation_checkpoint)
    if cfg.compile.enable:
        apply_compile(model)
    if dims.fsdp_enabled:
        mode = cfg.parallelism.fsdp_reshard_after_forward
        apply_fsdp(
            model,
            meshes.fsdp,
            param_dtype=cfg.param_dtype,
            reduce_dtype=cfg.reduce_dtype,
            reshard_after_forward=mode == "always" or (mode == "default" and not cfg.pipeline),
            expert_mesh=meshes.expert_fsdp,
        )
