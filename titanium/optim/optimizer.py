"""AdamW/Adam (torch) or low-bit AdamW (torchao) over the (possibly sharded) parameters, with weight decay on
matrices only, optionally stepped inside backward."""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from titanium.config.loader import ConfigError
from titanium.config.sections import OptimizerSection
from titanium.optim.in_backward import OptimizerFactory, OptimizerInBackward

logger = logging.getLogger("titanium")

LOW_BIT = ("AdamW8bit", "AdamW4bit", "AdamWFp8")
"""AdamW variants of torchao.optim whose moments are stored quantized (they all run on CPU and CUDA)."""


def param_groups(model: nn.Module, cfg: OptimizerSection) -> list[dict]:
    """Two groups: matrices decay; norms, biases and embeddings do not (unless asked).

    Decaying a norm's gain or an embedding row pulls it toward zero for no benefit, so the
    usual practice (GPT-3, Llama) exempts them.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        exempt = param.ndim < 2 or id(param) in embeddings
        (no_decay if exempt and not cfg.decay_norms_and_embeddings else decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, cfg: OptimizerSection) -> torch.optim.Optimizer:
    """The optimizer over the model's trainable parameters; with ``early_step_in_backward`` its steps run in
    backward and ``step()``/``zero_grad()`` have nothing left to do, so the loop is the same either way."""
    groups = param_groups(model, cfg)
    device = groups[0]["params"][0].device if groups[0]["params"] else torch.device("cpu")
    make = optimizer_factory(cfg, device)
    if cfg.early_step_in_backward:
        return OptimizerInBackward(groups, make)
    return make(groups)


def optimizer_factory(cfg: OptimizerSection, device: torch.device) -> OptimizerFactory:
    """What builds the configured optimizer from param groups (for the whole model, or one parameter)."""
    betas = (cfg.beta1, cfg.beta2)
    if cfg.name in LOW_BIT:
        if cfg.name == "AdamWFp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise ConfigError(
                f"--optimizer.name AdamWFp8 needs a GPU with FP8 support (compute capability 8.9+, e.g. H100 or L4); "
                f"{torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)}; "
                "use AdamW8bit (same memory) instead"
            )
        if cfg.tensor_lr:
            logger.info("--optimizer.tensor_lr: %s always keeps its LR in a tensor", cfg.name)
        import torchao.optim  # (heavy: only when asked for)

        return functools.partial(getattr(torchao.optim, cfg.name), lr=cfg.lr, betas=betas, eps=cfg.eps)
    fused, foreach = cfg.implementation == "fused", cfg.implementation == "foreach"
    lr = learning_rate(cfg, device)
    optimizer_cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[cfg.name]
    # A tensor LR outside the fused kernels needs capturable math (on-device bias correction): without it
    # foreach refuses a tensor LR and the for-loop reads it back to the host every step.
    capturable = isinstance(lr, torch.Tensor) and not fused
    return functools.partial(
        optimizer_cls, lr=lr, betas=betas, eps=cfg.eps, fused=fused, foreach=foreach, capturable=capturable
    )


def learning_rate(cfg: OptimizerSection, device: torch.device) -> float | torch.Tensor:
    """The peak LR as given (a float) or, with ``tensor_lr``, as a 0-dim tensor where the step reads it.

    CUDA's fused kernels read a float32 LR tensor; on CPU a float64 one keeps every update bitwise equal to
    a float LR (the kernels compute with the LR in double there).
    """
    if not cfg.tensor_lr:
        return cfg.lr
    if device.type == "cuda":
        return torch.tensor(cfg.lr, dtype=torch.float32, device=device)
    if cfg.implementation == "fused":
        return torch.tensor(cfg.lr, dtype=torch.float64, device=device)
    logger.warning(
        "--optimizer.tensor_lr: the LR stays a float on %s; a tensor LR with --optimizer.implementation %s needs "
        "torch's capturable mode, which runs on CUDA only (fused takes a tensor LR everywhere)",
        device.type,
        cfg.implementation,
    )
    return cfg.lr
