"""Activation checkpointing per transformer block: full, selective per op, or every N-th block."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titanium.config.sections import ActivationCheckpointSection


def _ops_to_save() -> set:
    """Outputs worth keeping under per-op SAC: the expensive ones (matmuls, attention) and the results
    of tensor-parallel reduce-scatters (recomputing those would repeat the communication)."""
    aten = torch.ops.aten
    names = [
        (aten, "mm"),
        (aten, "addmm"),
        (aten, "bmm"),
        (aten, "_scaled_mm"),  # float8 matmuls (the float8 converter), CUDA
        (aten, "_scaled_dot_product_flash_attention"),  # CUDA
        (aten, "_scaled_dot_product_efficient_attention"),  # CUDA
        (aten, "_scaled_dot_product_cudnn_attention"),  # CUDA
        (aten, "_scaled_dot_product_flash_attention_for_cpu"),  # CPU: what SDPA dispatches to here
        (torch.ops._c10d_functional, "reduce_scatter_tensor"),
    ]
    return {getattr(ns, name).default for ns, name in names if hasattr(ns, name)}


def _op_sac_policy(save: set, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE


def _op_sac_context():
    return create_selective_checkpoint_contexts(partial(_op_sac_policy, _ops_to_save()))


def apply_activation_checkpointing(model: nn.Module, cfg: ActivationCheckpointSection) -> None:
    """Wrap the blocks of ``model.layers`` in place.

    full: each block keeps only its input and recomputes its forward during backward (the least
    memory: about one [batch, seq, dim] tensor per block). selective "op": per-op policy, keeps
    matmul and attention outputs and recomputes elementwise ops and norms. selective "N": full
    checkpointing of every N-th block (N=1 equals full). The checkpoint wrapper's name prefix is
    invisible in state dicts, so checkpoints do not depend on the mode.
    """
    if cfg.mode == "none":
        return
    every = 1
    if cfg.mode == "selective" and cfg.selective_ac_option != "op":
        every = int(cfg.selective_ac_option)
    per_op = cfg.mode == "selective" and cfg.selective_ac_option == "op"
    for i, (name, block) in enumerate(list(model.layers.items())):
        if per_op:
            model.layers[name] = checkpoint_wrapper(block, context_fn=_op_sac_context, preserve_rng_state=False)
        elif i % every == 0:
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
