"""Registries of titanium's pluggable components, and the job config they shape.

A component (an objective, a model converter, an evaluation, a loss variant, a reward function) registers under a
name with the ``module:attribute`` that implements it, imported only when used, and with its config section, if it
has one: a name and a dataclass, plus any further sections it reads (GRPO's ``[rollout]``, the engine it generates
with). The job config is the core sections plus every registered section, so the TOML file, the command line,
``--help`` and docs/configuration.md know them all before anything heavy is imported, and each component is handed
its own sections and nothing else. Wherever a name is asked for, an import path ``package.module:attribute`` works
too (your own component, no registration needed); an objective given that way brings its section along as its class
attribute ``section`` (a ``SectionSpec``), and the others as ``more_sections``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from titanium.config.errors import ConfigError


@dataclass(frozen=True)
class SectionSpec:
    """A component's config section: ``[name]`` in TOML, ``--name.key`` on the command line."""

    name: str
    cls: type


DATA_KINDS = ("text", "synthetic", "chat", "instruct", "preference", "unpaired")
"""The ``[data] kind`` values a dataset resolves to (``auto`` becomes one of them at start-up)."""


@dataclass(frozen=True)
class Needs:
    """What an objective needs of the rest of the job, declared where it is registered: the job-wide checks
    (config/validate.py, preflight.py) and the data set-up read these instead of naming objectives. An objective
    given by import path declares them as its class attribute ``needs`` (else: any data, no other limit)."""

    data_kinds: tuple[str, ...] = DATA_KINDS
    """The ``[data]`` kinds it reads."""
    data_what: str = ""
    """How an error names that data, e.g. "needs preference pairs: --data.kind preference"."""
    rows: str = "samples"
    """What one data row is to it: "documents" (text whatever the columns: --data.kind auto reads nothing),
    "samples" (a prompt and its completion, trained on), "pairs" (preference or labelled rows), or "prompts" (what
    the rollout source samples completions for). Says what a string row means in the start-up line."""
    token_loss: bool = False
    """Its loss is a token cross-entropy, which ``--training.loss_chunk_size`` computes chunk by chunk."""
    held_out_loss: bool = True
    """A held-out loss means something for it (``[validation]``); not for losses that need rollouts."""
    score_head: bool = False
    """Its model ends in a scalar score head (a reward model, PPO's value model)."""
    images: bool = False
    """Its rows may carry images to an image-text model (docs/vision.md); one that cannot would train on the rows'
    text and drop their images, so an image-text model refuses it."""


@dataclass(frozen=True)
class Component:
    name: str
    target: Any
    """``"module:attribute"`` (imported when first used) or the object itself."""
    section: SectionSpec | None = None
    more_sections: tuple[SectionSpec, ...] = ()
    """Further sections it reads, handed to it by keyword under their names (GRPO's ``rollout=``)."""
    needs: Needs = Needs()
    """What it needs of the rest of the job (objectives)."""


class Registry:
    """Components of one kind by name, in registration order (converters apply in it)."""

    def __init__(self, kind: str, flag: str) -> None:
        self.kind, self.flag = kind, flag
        """What they are ("objective") and the config key that names them ("--training.objective")."""
        self._components: dict[str, Component] = {}

    def register(
        self,
        name: str,
        target: Any,
        section: SectionSpec | None = None,
        more_sections: tuple[SectionSpec, ...] = (),
        needs: Needs = Needs(),
    ) -> Component:
        """Add ``name``; registering a taken name with another target is an error (the same one again is not)."""
        component = Component(name, target, section, more_sections, needs)
        if self._components.get(name, component) != component:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        specs = ((section,) if section is not None else ()) + more_sections
        for spec in specs:
            if spec.name in SECTIONS and SECTIONS[spec.name] is not spec.cls:
                raise ValueError(f"config section [{spec.name}] is already taken")
        self._components[name] = component
        for spec in specs:
            SECTIONS[spec.name] = spec.cls
        return component

    def __contains__(self, name: str) -> bool:
        return name in self._components

    def __iter__(self):
        return iter(self._components.values())

    def names(self) -> list[str]:
        return list(self._components)

    def known(self, name: str) -> bool:
        """Registered, or shaped like an import path (whether it imports is found when it is loaded)."""
        return name in self._components or ":" in name

    def load(self, name: str) -> Any:
        """The object registered as ``name``, or at the import path ``name``."""
        component = self._components.get(name)
        target = component.target if component is not None else name
        if not isinstance(target, str):
            return target
        if component is None and ":" not in name:
            valid = ", ".join(self.names())
            raise ConfigError(
                f"{self.flag} {name!r} is not a known {self.kind}; valid: {valid}, or your own as "
                "'package.module:attribute'"
            )
        module_name, _, attribute = target.partition(":")
        try:
            obj = importlib.import_module(module_name)
            for part in attribute.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"{self.flag} {name!r}: cannot import {target} ({e})") from None
        return obj

    def section(self, name: str) -> SectionSpec | None:
        """The config section of ``name``: registered with it, or (an import path) the class's ``section``."""
        component = self._components.get(name)
        if component is not None:
            return component.section
        return getattr(self.load(name), "section", None)

    def more_sections(self, name: str) -> tuple[SectionSpec, ...]:
        """The further sections ``name`` reads: registered with it, or (an import path) the class's
        ``more_sections``."""
        component = self._components.get(name)
        if component is not None:
            return component.more_sections
        return tuple(getattr(self.load(name), "more_sections", ()))

    def needs(self, name: str) -> Needs:
        """What ``name`` needs of the job: registered with it, or (an import path) the class's ``needs``."""
        component = self._components.get(name)
        if component is not None:
            return component.needs
        return getattr(self.load(name), "needs", Needs()) if ":" in name else Needs()

    def reads(self, name: str, section: str) -> bool:
        """Whether ``name`` reads the config section ``[section]`` (its own or a further one)."""
        if not self.known(name):
            return False
        own = self.section(name)
        return any(spec.name == section for spec in ((own,) if own else ()) + self.more_sections(name))


SECTIONS: dict[str, type] = {}
"""Component config sections by name, in registration order (the core ones are ``CoreConfig``'s fields)."""
