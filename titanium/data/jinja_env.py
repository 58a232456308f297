"""The sandboxed Jinja environment chat templates are written for: the one `transformers` renders them in.

Templates from the hub use more than plain Jinja: ``raise_exception(msg)``, a ``tojson`` that keeps
non-ASCII text, ``strftime_now(fmt)`` (today's date in a system prompt) and ``{% generation %}`` blocks
around assistant text. transformers uses the blocks to build assistant-token masks; titanium finds the
masks by rendering growing prefixes instead (titanium.data.chat.JinjaTemplate), so here a block simply
renders its body, in its own scope as in transformers.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment


class GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}``: renders what it encloses."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def raise_exception(message: str) -> None:
    raise TemplateError(message)


def tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Jinja's own tojson escapes HTML characters; templates expect plain JSON."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def chat_template_environment() -> ImmutableSandboxedEnvironment:
    """A sandbox with the settings and helpers of transformers' chat templates, so text comes out the same."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, "jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.filters["tojson"] = tojson
    return env
