"""Tool calls parsed from a policy turn's text, in the format the model's chat template defines, by name
(``--environment.tool_parser``; ``register_tool_parser`` adds one).

- ``hermes``: Qwen 2.5 / Qwen 3 / Hermes: each call a JSON object ``{"name": ..., "arguments": {...}}`` between
  ``<tool_call>`` and ``</tool_call>``, any number of them, text around them being the turn's content.
- ``llama3_json``: Llama 3.1 / 3.2's JSON tool calling: the whole turn (after an optional ``<|python_tag|>``) is one
  JSON object ``{"name": ..., "parameters": {...}}`` (``"arguments"`` is read too), or several separated by ``;``.
- ``pythonic``: Llama 3.2 / 4's pythonic calls: the whole turn is a Python list of calls with keyword arguments of
  literal values, ``[calculate(expression="3 * 4"), search(query="x")]`` (short: the bundled debug task uses it).

A call the parser recognises but cannot read (broken JSON, no name, arguments that are not an object, an unclosed
``<tool_call>``) is kept as a ``ToolCall`` with an ``error``: the environment answers it with that error, so the
model sees its mistake, and it is counted; it never raises.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from titanium.config.registry import Registry


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    """Why the call could not be read (malformed); None for a well-formed call."""

    def as_dict(self) -> dict[str, Any]:
        """The call as chat templates read an assistant message's ``tool_calls`` entries."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedTurn:
    content: str
    """The turn's text without its tool calls."""
    calls: list[ToolCall]


ToolParser = Callable[[str], ParsedTurn]

TOOL_PARSERS = Registry("tool-call parser", "--environment.tool_parser")


def register_tool_parser(name: str) -> Callable[[ToolParser], ToolParser]:
    """Decorator: make ``fn(text) -> ParsedTurn`` available as ``--environment.tool_parser name``."""

    def add(fn: ToolParser) -> ToolParser:
        TOOL_PARSERS.register(name, fn)
        return fn

    return add


def _call(text: str, arguments_keys: tuple[str, ...]) -> ToolCall:
    """One call from its JSON text; malformed: a ToolCall with the error (its name if it could be read)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return ToolCall("", error=f"the tool call is not valid JSON ({e.msg} at column {e.colno}): {text[:200]}")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return ToolCall("", error=f'a tool call is a JSON object with a "name" string: {text[:200]}')
    arguments = next((value[k] for k in arguments_keys if k in value), {})
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):  # (some models write the arguments as a JSON string)
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(value["name"], error=f"the arguments of a call to {value['name']!r} are not a JSON object")
    return ToolCall(value["name"], arguments)


_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@register_tool_parser("hermes")
def hermes(text: str) -> ParsedTurn:
    calls, content = [], []
    last = 0
    for found in _HERMES.finditer(text):
        content.append(text[last : found.start()])
        last = found.end()
        if not found.group(2):
            calls.append(ToolCall("", error="a <tool_call> was not closed by </tool_call>"))
        else:
            calls.append(_call(found.group(1).strip(), ("arguments", "parameters")))
    content.append(text[last:])
    return ParsedTurn("".join(content).strip(), calls)


@register_tool_parser("llama3_json")
def llama3_json(text: str) -> ParsedTurn:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedTurn(text.strip(), [])
    parts = [body]
    if ";" in body:  # (several calls: split where a new object starts)
        parts = [p.strip() for p in re.split(r"(?<=\})\s*;\s*(?=\{)", body)]
    return ParsedTurn("", [_call(p, ("parameters", "arguments")) for p in parts])


@register_tool_parser("pythonic")
def pythonic(text: str) -> ParsedTurn:
    body = text.strip()
    if not (body.startswith("[") and body.endswith("]") and "(" in body):
        return ParsedTurn(text.strip(), [])
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError as e:
        return ParsedTurn(
            "", [ToolCall("", error=f"the tool calls are not a Python list of calls ({e.msg}): {body[:200]}")]
        )
    if not isinstance(tree, ast.List):
        return ParsedTurn("", [ToolCall("", error=f"the tool calls are not a Python list of calls: {body[:200]}")])
    return ParsedTurn("", [_pythonic_call(node) for node in tree.elts])


def _pythonic_call(node: ast.expr) -> ToolCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return ToolCall("", error=f"a tool call is name(argument=value, ...): {ast.unparse(node)[:200]}")
    name = node.func.id
    if node.args:
        return ToolCall(name, error=f"the call to {name!r} passes arguments by position; name them (argument=value)")
    try:
        arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
    except ValueError:
        return ToolCall(name, error=f"the arguments of the call to {name!r} are not literal values")
    return ToolCall(name, arguments)
