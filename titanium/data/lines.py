"""Local JSON-lines and text files, read one line at a time so that one bad line is one bad row.

The `datasets` library parses such files in blocks: a single line that is not UTF-8 or not JSON stops the
whole stream, hours into a run, and names the block's first row rather than the broken one. Read here, the
line becomes a `BadLine` that the row readers skip and count, or report, like any other malformed row.
Row N is line N + 1 of the file: blank lines keep their number but hold no row.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_PEEK_BYTES = 1 << 16  # enough to find the first character of any real file


@dataclass(frozen=True)
class BadLine:
    """A line that is no row at all (not UTF-8, not JSON); the reader skips or reports it per --data.on_bad_row."""

    problem: str


def first_character(path: Path) -> str | None:
    """The first non-whitespace character of the file (None: the file is empty or blank)."""
    with open(path, "rb") as f:
        head = f.read(_PEEK_BYTES).lstrip()
    return chr(head[0]) if head else None


def reads_by_line(path: Path) -> bool:
    """.jsonl and .txt files are read here, and so is a .json file unless it is one JSON array (read whole)."""
    return path.suffix in (".jsonl", ".txt") or (path.suffix == ".json" and first_character(path) != "[")


def read_lines(path: Path, start_row: int) -> Iterator[tuple[int, Any]]:
    """(row, value) from `start_row` on: a parsed object for JSON lines, {"text": line} for .txt, or a BadLine.

    A .txt line keeps everything but its line break ("\\n" or "\\r\\n"), as the `datasets` text builder does.
    """
    is_text = path.suffix == ".txt"
    with open(path, "rb") as f:
        for row, raw in enumerate(f):
            if row < start_row:
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield row, BadLine(f"not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})")
                continue
            if is_text:
                yield row, {"text": line.removesuffix("\n").removesuffix("\r")}
            elif line.strip():
                try:
                    yield row, json.loads(line)
                except json.JSONDecodeError as e:
                    yield row, BadLine(f"not valid JSON ({e.msg} at column {e.colno})")
