"""AdamW/Adam over the (possibly sharded) parameters, with weight decay on matrices only."""

from __future__ import annotations

import torch
from torch import nn

from titanium.config.sections import OptimizerSection


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
    kwargs = {
        "lr": cfg.lr,
        "betas": (cfg.beta1, cfg.beta2),
        "eps": cfg.eps,
        "fused": cfg.implementation == "fused",
        "foreach": cfg.implementation == "foreach",
    }
    optimizer_cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[cfg.name]
    return optimizer_cls(param_groups(model, cfg), **kwargs)
