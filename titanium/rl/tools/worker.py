"""The tool process: ``python -m titanium.rl.tools.worker CONFIG_JSON`` loads the tools, caps its own memory, then
answers one JSON request per line on stdin (``{"name", "arguments"}``) with one JSON line on the original stdout
(``{"content"}`` or ``{"error"}``). What the tools print goes to /dev/null, so it can never break the protocol or
flood a pipe. It stays light: no torch, only the tools' own imports.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any

from titanium.rl.tools.loading import load_function

TEXT_TYPES = (str, int, float, bool, type(None))


def as_text(value: Any) -> str | None:
    """A tool's result as the text the model reads (``str``, as TRL writes ``str(result)``): text, numbers, booleans,
    None, and lists / tuples / dicts of those; None for anything else (bytes, objects...), which is no text."""
    if isinstance(value, TEXT_TYPES) or _plain(value):
        return str(value)
    return None


def _plain(value: Any, depth: int = 0) -> bool:
    if depth > 20:
        return False
    if isinstance(value, TEXT_TYPES):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, TEXT_TYPES) and _plain(v, depth + 1) for k, v in value.items())
    return False


def answer(tools: dict[str, Any], request: dict[str, Any], output_chars: int) -> dict[str, str]:
    name = request["name"]
    try:
        result = tools[name](**request["arguments"])
    except MemoryError:
        return {"error": f"the tool {name!r} ran out of memory"}
    except Exception as e:  # (the tool's own failure: the model reads it)
        return {"error": f"{type(e).__name__}: {e}"}
    text = as_text(result)
    if text is None:
        return {"error": f"the tool {name!r} returned a {type(result).__name__}, not text"}
    if len(text) > output_chars:
        return {"error": f"the tool {name!r} returned {len(text)} characters, more than the limit of {output_chars}"}
    return {"content": text}


def _write(fd: int, message: dict[str, Any]) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


def main() -> None:
    config = json.loads(sys.argv[1])
    protocol = os.dup(1)
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    try:
        tools = {name: load_function(spec) for name, spec in config["tools"].items()}
    except Exception as e:
        _write(protocol, {"ready": False, "error": str(e)})
        return
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    limit = config["memory_mb"] * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    _write(protocol, {"ready": True})
    for line in sys.stdin:
        try:
            reply = answer(tools, json.loads(line), config["output_chars"])
        except MemoryError:
            reply = {"error": "the tool ran out of memory"}
        _write(protocol, reply)


if __name__ == "__main__":
    main()
