"""A tool function from its reference: ``"package.module:function"`` (importable) or ``"path/to/file.py:function"``.

Any failure to load it (no such file, a syntax error or an exception while importing, no such name, not a
function) is the user's config to fix: a ConfigError naming the option, so the run stops with exit code 2 before
anything starts, not at the first tool call.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from titanium.config.errors import ConfigError


def load_function(spec: str, option: str = "--environment.tools") -> Callable[..., Any]:
    path, _, attribute = spec.rpartition(":")
    if not path or not attribute:
        raise ConfigError(f"{option} {spec!r}: name a function as 'package.module:function' or 'file.py:function'")
    try:
        module = _file_module(spec, Path(path), option) if path.endswith(".py") else importlib.import_module(path)
    except ConfigError:
        raise
    except BaseException as e:  # (the user's module failed to import: SyntaxError, ImportError, anything it raised)
        if isinstance(e, KeyboardInterrupt):
            raise
        raise ConfigError(f"{option} {spec!r}: {path} does not import ({type(e).__name__}: {e})") from None
    fn = module
    for part in attribute.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ConfigError(f"{option} {spec!r}: {path} has no {attribute!r}")
    if not callable(fn):
        raise ConfigError(f"{option} {spec!r} is not a function")
    return fn


def _file_module(spec: str, path: Path, option: str) -> Any:
    if not path.is_file():
        raise ConfigError(f"{option} {spec!r}: no file {path}")
    name = f"titanium_tools_{path.stem}"
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path.resolve()):
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path.resolve())
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def reference(fn: Callable[..., Any]) -> str:
    """The reference a worker process loads ``fn`` by: its module (or file, for one loaded by path) and name."""
    module = sys.modules.get(fn.__module__)
    if fn.__module__.startswith("titanium_tools_") and module is not None and module.__file__:
        return f"{module.__file__}:{fn.__qualname__}"
    if fn.__module__ == "__main__" or "<locals>" in fn.__qualname__:
        raise ConfigError(
            f"tool {fn.__qualname__!r} is defined in {fn.__module__}, where a tool process cannot import it; define "
            "it at the top level of a module or file and name it as 'package.module:function' or 'file.py:function'"
        )
    return f"{fn.__module__}:{fn.__qualname__}"
