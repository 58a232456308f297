"""What the trainer needs to know about a model family, in one record."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    """A model family as seen by the trainer, so the trainer never imports a model directly.

    Slots:
        name: registry key, matched against ``[model] name`` in the job config.
        model_cls: the ``nn.Module`` class, constructed as ``model_cls(args)``, preferably
            on the meta device and then materialised with ``to_empty`` + ``init_weights``.
        flavors: size presets, flavor name -> args dataclass; the trainer picks one with
            ``[model] flavor`` and overrides fields via ``build_model_args``.
        flops_per_token: ``(args, seq_len) -> float`` training FLOPs per token
            (forward + backward), used for MFU; must not allocate the model.
        parallelize_fn: applies tensor/data/context parallelism, activation checkpointing
            and compilation to a built model; None until the family supports it.
        pipeline_fn: splits the model into pipeline stages; None if unsupported.
        hf_adapter: converts state dicts to and from the Hugging Face format; None if absent.
    """

    name: str
    model_cls: type[nn.Module]
    flavors: Mapping[str, Any]
    flops_per_token: Callable[[Any, int], float]
    parallelize_fn: Callable[..., Any] | None = None
    pipeline_fn: Callable[..., Any] | None = None
    hf_adapter: Any | None = None
