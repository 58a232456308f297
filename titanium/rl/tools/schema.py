"""Plain Python functions as tools: their JSON schema from type hints and the docstring, as TRL and transformers
write it (``transformers.utils.get_json_schema``, which ``apply_chat_template(tools=[fn])`` uses), so a chat
template renders the same tool list for titanium as for TRL's ``GRPOTrainer(tools=[fn])``.

The convention: the first paragraph of the docstring describes the function; a Google-style ``Args:`` section
describes each parameter (continuation lines indented); an optional ``Returns:`` section the result. Every parameter
needs a type hint; one without a default is required.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable
from typing import Any

from titanium.config.errors import ConfigError

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
_SECTION = re.compile(r"^\s*(Args|Arguments|Returns|Raises)\s*:\s*$", re.MULTILINE)


def json_schema(fn: Callable[..., Any], option: str = "--environment.tools") -> dict[str, Any]:
    """``{"type": "function", "function": {name, description, parameters, [return]}}`` of ``fn``; ConfigError
    (naming ``option``) for a function without a docstring, or with a parameter without a type hint or description."""
    name = getattr(fn, "__name__", repr(fn))
    doc = inspect.getdoc(fn)
    if not doc:
        raise ConfigError(f"{option}: tool {name!r} has no docstring; its first line describes it to the model")
    description, args, returns = _docstring(doc)
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.name not in hints:
            raise ConfigError(f"{option}: parameter {param.name!r} of tool {name!r} has no type hint")
        if param.name not in args:
            raise ConfigError(f"{option}: parameter {param.name!r} of tool {name!r} is not described under Args:")
        properties[param.name] = {**_type_schema(hints[param.name], name), "description": args[param.name]}
        if param.default is param.empty:
            required.append(param.name)
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    function: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if "return" in hints and hints["return"] is not type(None):
        try:  # (a return type with no JSON type is left out, as transformers does: the model never writes it)
            function["return"] = _type_schema(hints["return"], name)
        except ConfigError:
            pass
        else:
            if returns:
                function["return"]["description"] = returns
    return {"type": "function", "function": function}


def _docstring(doc: str) -> tuple[str, dict[str, str], str | None]:
    """(description, {parameter: description}, returns description) of a Google-style docstring."""
    parts = _SECTION.split(doc)
    description = parts[0].strip()
    args: dict[str, str] = {}
    returns = None
    for title, body in zip(parts[1::2], parts[2::2]):
        if title in ("Args", "Arguments"):
            current = None
            for line in body.splitlines():
                found = re.match(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
                if found and (current is None or _indent(line) <= _indent_of_first(body)):
                    current = found.group(1)
                    args[current] = found.group(2).strip()
                elif current is not None and line.strip():
                    args[current] = f"{args[current]} {line.strip()}".strip()
        elif title == "Returns":
            returns = body.strip() or None
    return description, args, returns


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _indent_of_first(body: str) -> int:
    return next((_indent(line) for line in body.splitlines() if line.strip()), 0)


def _type_schema(hint: Any, tool: str) -> dict[str, Any]:
    """The JSON schema of a type hint (transformers' mapping: scalars, lists, tuples, dicts, unions, Literal)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        schema = (
            _type_schema(members[0], tool) if len(members) == 1 else _union([_type_schema(m, tool) for m in members])
        )
        return {**schema, "nullable": True} if len(members) < len(args) else schema
    if origin is typing.Literal:
        kinds = list(dict.fromkeys(_JSON_TYPES[type(a)] for a in args))
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(args)}
    if origin in (list, typing.List):  # noqa: UP006 (the hint may be written either way)
        return {"type": "array", **({"items": _type_schema(args[0], tool)} if args else {})}
    if origin in (tuple, typing.Tuple):  # noqa: UP006
        if not args:
            return {"type": "array"}
        return {"type": "array", "prefixItems": [_type_schema(a, tool) for a in args]}
    if origin in (dict, typing.Dict):  # noqa: UP006
        return {"type": "object", **({"additionalProperties": _type_schema(args[1], tool)} if args else {})}
    if hint in (list, tuple):
        return {"type": "array"}
    if hint is dict:
        return {"type": "object"}
    if hint is Any:
        return {}
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    raise ConfigError(f"--environment.tools: tool {tool!r} has a parameter of type {hint!r}, which has no JSON type")


def _union(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    """A union of plain types as one schema with a list of types; of anything else, ``anyOf``."""
    if all(set(s) == {"type"} and isinstance(s["type"], str) for s in schemas):
        names = sorted({s["type"] for s in schemas})
        return {"type": names[0] if len(names) == 1 else names}
    return {"anyOf": schemas}
