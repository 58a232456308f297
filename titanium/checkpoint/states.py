"""Stateful adapters: what each part of the training state looks like inside a DCP checkpoint."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titanium.parallel.params import clean_fqn

ModelPart = Literal["all", "trainable", "base"]
"""Which of a model's weights a checkpoint holds or a load reads (``ModelState``)."""


class ModelState:
    """Model weights by fully-qualified name; sharded tensors stay sharded (DCP reshards on load).

    ``part`` selects what is saved and loaded. When a converter freezes the base (LoRA) a run's
    checkpoints hold only the ``"trainable"`` parameters, and its frozen ``"base"`` is read from where
    the run started (every start, resumed or not); ``"all"`` is everything. Freeze before building this.
    """

    def __init__(self, model: nn.Module, part: ModelPart = "all") -> None:
        self.model = model
        self.part = part

    def state_dict(self) -> dict[str, Any]:
        options = StateDictOptions(ignore_frozen_params=self.part == "trainable")
        state = get_model_state_dict(self.model, options=options)
        if self.part == "base":
            frozen = {clean_fqn(n) for n, p in self.model.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k in frozen}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state, options=StateDictOptions(strict=self.part == "all"))


class OptimizerState:
    """Optimizer moments keyed by parameter name (not position), so layouts can change."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    # Flattened ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"): ranks holding different parameters
    # (pipeline stages) then write disjoint keys instead of conflicting param_groups lists.
    _OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer, options=self._OPTIONS)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state, options=self._OPTIONS)


class TrainState:
    """Step and tokens seen, stored as tensors (identical on every rank)."""

    def __init__(self) -> None:
        self.step = 0
        self.tokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step), "tokens_seen": torch.tensor(self.tokens_seen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])


class RNGState:
    """This rank's CPU (and CUDA) generator states, so dropout and sampling resume identically."""

    def state_dict(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
