"""The job config class: the core sections plus every registered component's section, one dataclass field each."""

from __future__ import annotations

import dataclasses
import functools

from titanium.config.errors import ConfigError
from titanium.config.registry import SECTIONS, SectionSpec
from titanium.config.sections import CoreConfig


def job_config_class(extra: tuple[SectionSpec, ...] = ()) -> type:
    """The job config: the core sections, every registered component's section and ``extra`` ones (an objective
    given by import path), one dataclass field each."""
    return _job_config_class(tuple(SECTIONS.items()), extra)


@functools.cache
def _job_config_class(registered: tuple[tuple[str, type], ...], extra: tuple[SectionSpec, ...]) -> type:
    core = {f.name for f in dataclasses.fields(CoreConfig)}
    sections = [*registered, *((s.name, s.cls) for s in extra)]
    for name, _ in sections:
        if name in core:
            raise ConfigError(f"config section [{name}] is a core section; give the component another name")
    fields = [(name, cls, dataclasses.field(default_factory=cls)) for name, cls in dict(sections).items()]
    cls = dataclasses.make_dataclass("JobConfig", fields, bases=(CoreConfig,))
    cls.__doc__ = CoreConfig.__doc__
    cls.__module__ = CoreConfig.__module__
    return cls
