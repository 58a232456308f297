"""Render the config reference (docs/configuration.md) from the section dataclasses and their docstrings.

Generated, never hand-edited, so the docs cannot drift from the code: a test compares the file with
`render_reference()`; `python scripts/gen_config_docs.py` rewrites it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing

from titanium.config.components import JobConfig


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (a string literal right after a field) of a dataclass, by field name."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def _type_name(hint: typing.Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return " \\| ".join(f'"{a}"' for a in typing.get_args(hint))
    text = getattr(hint, "__name__", None) or str(hint)
    return str(text).replace("typing.", "").replace("|", "\\|")


def _default(value: typing.Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def render_reference() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from `titanium/config/sections.py` by `python scripts/gen_config_docs.py`; do not edit.",
        "",
        "Every key can be set in a TOML job config (`[section]` then `key = value`) or on the command line",
        "(`--section.key value`; booleans are flags: `--section.key` / `--section.no_key`). Precedence:",
        "defaults < TOML file (`--job.config_file`) < command line.",
        "",
    ]
    job = JobConfig()
    for section_field in dataclasses.fields(job):
        lines += _table(section_field.name, getattr(job, section_field.name))
    return "\n".join(lines)


def _table(name: str, section: typing.Any, doc: str = "") -> list[str]:
    """One section's table, then the tables of the dataclasses inside it (``[dpo.simpo]``), each under its name."""
    cls = type(section)
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    header = ["| key | type | default | description |", "|---|---|---|---|"]
    lines = [f"## [{name}]", "", *([doc, ""] if doc else []), *header]
    inner = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            inner += _table(f"{name}.{f.name}", value, docs.get(f.name, ""))
            continue
        lines.append(f"| `{f.name}` | {_type_name(hints[f.name])} | `{_default(value)}` | {docs.get(f.name, '')} |")
    return [*lines, "", *inner]
