"""Tool calling's parts in one process: tool calls parsed in each registered format (malformed ones kept with their
error), functions' JSON schemas equal to transformers' ``get_json_schema`` (what TRL renders), and the sandbox:
every way a tool can misbehave becomes an error the model reads, counted by outcome, and the sandbox goes on."""

from __future__ import annotations

import time

import pytest

from tests.objectives import tools
from titanium.config.errors import ConfigError
from titanium.rl.tools.loading import load_function, reference
from titanium.rl.tools.parsers import TOOL_PARSERS, ToolCall
from titanium.rl.tools.sandbox import ToolSandbox
from titanium.rl.tools.schema import json_schema


def test_hermes_calls() -> None:
    parse = TOOL_PARSERS.load("hermes")
    text = (
        'Let me see.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>'
    )
    turn = parse(text)
    assert turn.content == "Let me see."
    assert turn.calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("f", {"x": 1})]
    assert parse("just an answer").calls == []
    broken = parse('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>').calls
    assert broken[0].error and "JSON" in broken[0].error
    assert parse("<tool_call>[1, 2]</tool_call>").calls[0].error
    assert parse('<tool_call>{"name": "add", "arguments": [1]}</tool_call>').calls[0].error
    assert "not closed" in parse('<tool_call>{"name": "add"}').calls[0].error


def test_llama3_json_and_pythonic_calls() -> None:
    llama = TOOL_PARSERS.load("llama3_json")
    assert llama('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}').calls == [
        ToolCall("add", {"a": 1, "b": 2})
    ]
    two = llama('{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": "y"}}').calls
    assert two == [ToolCall("a"), ToolCall("b", {"x": "y"})]
    assert llama("The answer is 3.").calls == [] and llama("{broken").calls[0].error
    pythonic = TOOL_PARSERS.load("pythonic")
    assert pythonic('[add(a=1, b=2), calculate(expression="3 * 4")]').calls == [
        ToolCall("add", {"a": 1, "b": 2}),
        ToolCall("calculate", {"expression": "3 * 4"}),
    ]
    assert pythonic("42").calls == [] and pythonic("[1, 2]").calls == []
    assert pythonic("[add(1, 2)]").calls[0].error and pythonic("[add(a=x)]").calls[0].error
    assert pythonic('[add(a="1"').calls == []  # (not a list: an answer, not a call)
    assert pythonic("[add(a=1) +]").calls[0].error


def test_schemas_equal_transformers() -> None:
    pytest.importorskip("transformers")
    from transformers.utils import get_json_schema

    from titanium.rl.tools.calculator import calculate

    for fn in (tools.add, tools.fails, tools.hangs, tools.binary, calculate, _described):
        assert json_schema(fn) == get_json_schema(fn), fn.__name__


def _described(
    query: str,
    limit: int | None = None,
    kinds: list[str] | None = None,
    mode: str = "x",
    weights: dict[str, float] | None = None,
) -> dict:
    """Search for something.

    Two lines of description.

    Args:
        query: What to look for.
        limit: How many results
            at most.
        kinds (list): Which kinds.
        mode: The mode.
        weights: Per kind.

    Returns:
        The results,
        by kind.
    """
    return {}


def test_tool_files_that_do_not_load_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="does not import.*ModuleNotFoundError"):
        load_function("tests/objectives/broken_tools.py:tool")
    with pytest.raises(ConfigError, match="does not import"):
        load_function("tests.objectives.broken_tools:tool")
    with pytest.raises(ConfigError, match="no file"):
        load_function("no/such/file.py:tool")
    with pytest.raises(ConfigError, match="has no 'nope'"):
        load_function("tests.objectives.tools:nope")
    with pytest.raises(ConfigError, match="no docstring"):
        json_schema(lambda x: x)
    assert load_function("tests/objectives/tools.py:add")(a=1, b=2) == 3
    assert reference(load_function("tests/objectives/tools.py:add")).endswith("tests/objectives/tools.py:add")


def test_the_sandbox_turns_every_failure_into_an_error_the_model_reads() -> None:
    names = ("add", "fails", "hangs", "chatty", "huge", "binary", "hog", "dies")
    sandbox = ToolSandbox(
        {n: f"tests.objectives.tools:{n}" for n in names}, timeout=1.0, memory_mb=1024, output_chars=1000
    )
    try:
        calls = [
            (ToolCall("add", {"a": 1, "b": 2}), "ok", "3"),
            (ToolCall("fails", {"x": "way"}), "error", "ValueError: no way"),
            (ToolCall("hangs"), "timeout", "timed out after 1 s"),
            (ToolCall("add", {"a": 2, "b": 2}), "ok", "4"),  # (a fresh process after the kill)
            (ToolCall("chatty"), "ok", "done"),
            (ToolCall("huge"), "error", "10000000 characters, more than the limit of 1000"),
            (ToolCall("binary"), "error", "returned a bytes, not text"),
            (ToolCall("hog"), "error", "ran out of memory"),
            (ToolCall("dies"), "error", "took its process down (exit code 3)"),
            (ToolCall("add", {"a": 1}), "error", "missing 1 required positional argument"),
            (ToolCall("nope"), "error", "unknown tool 'nope'; the tools are: add, binary"),
            (ToolCall("", error="not JSON"), "error", "not JSON"),
            (ToolCall("add", {"a": 5, "b": 5}), "ok", "10"),
        ]
        start = time.monotonic()
        for call, outcome, text in calls:
            result = sandbox.call(call)
            assert result.outcome == outcome and text in result.content, (call, result)
        assert time.monotonic() - start < 30
    finally:
        sandbox.close()
