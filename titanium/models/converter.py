"""The converter seam: features that rewrite the model's modules on the meta device, before parallelization.

LoRA and QLoRA (``titanium/peft``) are converters; Float8 and QAT will be. The builder applies them in the
order they are given (quantization before LoRA, so LoRA wraps the already-converted layers it may adapt) and
calls their hooks; the trainer never names a converter. Every hook has a default that does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn


@dataclass(frozen=True)
class ConverterContext:
    """What a converter may need to know about the job besides its own config section."""

    shard_degree: int = 1
    """FSDP shards per weight (dp_shard x cp)."""
    fsdp: bool = False
    """The weights are FSDP-sharded."""
    device_type: str | None = None
    """Where the run computes; None: a dry run (no hardware checks)."""
    hf_adapter: Any = None
    """The family's Hugging Face adapter (its names: LoRA targets spelled as PEFT spells them); None: none."""


@dataclass(frozen=True)
class ExportContext:
    """What an export (at the end of training, or at a checkpoint save) needs to know about the run (no config beyond
    it)."""

    spec: Any
    """The model's ``ModelSpec`` (for its Hugging Face adapter)."""
    args: Any
    """The model's family args."""
    dump_folder: Path
    base_model_name_or_path: str | None
    """The Hugging Face folder the run started from, if any."""
    pp_group: Any = None
    """The pipeline group when stages are spread over ranks (exports gather over it)."""
    step: int | None = None
    """None at the end of training; the step of a checkpoint save that exports too ([checkpoint] export_at_saves)."""
    save_tokenizer: Callable[[Path], object] | None = None
    """Writes the run's tokenizer and chat template into an export folder (every export carries them)."""

    def folder(self, name: str) -> str:
        """Where an export configured to go to ``name`` (relative to dump_folder) writes: ``name`` at the end of
        training, ``name-step-N`` at a checkpoint save, so the final export never replaces the mid-run ones."""
        return name if self.step is None else f"{name}-step-{self.step}"


class ModelConverter:
    """Rewrites modules of the meta model; optional hooks after materialization and after each optimizer step.

    A converter is registered with its config section (titanium/config/components.py) and made by ``from_config``.
    """

    name = "converter"
    materialize_before_parallelize = False
    """True when the converter must see full, unsharded weights (e.g. QLoRA quantizes whole tensors), so the
    builder materializes and loads the model before parallelizing it (each rank briefly holds it all)."""
    freezes_base = False
    """True when the converter freezes the original weights (LoRA): checkpoints then hold only what trains,
    and the base is read from where the run started on every start, resumed or not."""

    @classmethod
    def from_config(cls, section: Any, ctx: ConverterContext) -> ModelConverter | None:
        """The converter its section asks for, or None when the section leaves it off."""
        raise NotImplementedError(f"{cls.__name__} has no from_config")

    def convert(self, model: nn.Module) -> None:
        """Rewrite ``model`` (on the meta device, before the pipeline split) in place."""

    def after_materialize(self, model: nn.Module, seed: int) -> None:
        """Weights now hold their starting values (initialized or loaded): set the converter's own."""

    def trainable(self, name: str) -> bool | None:
        """Whether parameter ``name`` trains; None when this converter has no say."""
        return None

    def after_optimizer_step(self, model_parts: list[nn.Module]) -> None:
        """Called after every optimizer step (e.g. Float8 scale precompute)."""

    def without_conversion(self, model: nn.Module) -> contextlib.AbstractContextManager[None] | None:
        """A context in which ``model`` computes what the unconverted model would (LoRA: adapters off), or None
        if the converter cannot offer one. Lets an objective use the policy as its own frozen reference."""
        return None

    def export(self, model: nn.Module, ctx: ExportContext) -> None:
        """Write the converter's own artifacts at the end of training (e.g. a PEFT adapter)."""

    def describe(self) -> str:
        return self.name


def apply_converters(converters: list[ModelConverter], model: nn.Module) -> None:
    for converter in converters:
        converter.convert(model)


def set_trainable(converters: list[ModelConverter], model: nn.Module) -> None:
    """Each parameter trains unless a converter says it does not (the last converter with a say wins)."""
    for name, param in model.named_parameters():
        verdicts = [v for c in converters if (v := c.trainable(name)) is not None]
        if verdicts:
            param.requires_grad_(verdicts[-1])


def can_switch_off(converters: list[ModelConverter], model: nn.Module) -> bool:
    """Whether ``model`` can run without every one of ``converters`` in place (each offers ``without_conversion``)."""
    return all(converter.without_conversion(model) is not None for converter in converters)


@contextlib.contextmanager
def unconverted(converters: list[ModelConverter], model: nn.Module) -> Iterator[None]:
    """Run ``model`` without ``converters`` inside the block (each must offer that: ``can_switch_off``)."""
    with contextlib.ExitStack() as stack:
        for converter in converters:
            ctx = converter.without_conversion(model)
            if ctx is None:
                raise ValueError(f"{converter.describe()} cannot run the model without its conversion")
            stack.enter_context(ctx)
        yield
