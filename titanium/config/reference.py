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
        section = getattr(job, section_field.name)
        cls = type(section)
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        lines += [f"## [{section_field.name}]", "", "| key | type | default | description |", "|---|---|---|---|"]
        for f in dataclasses.fields(section):
            default = _default(getattr(section, f.name))
            lines.append(f"| `{f.name}` | {_type_name(hints[f.name])} | `{default}` | {docs.get(f.name, '')} |")
        lines.append("")
    return "\n".join(lines)
