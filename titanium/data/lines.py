"""Local JSON-lines and text files, read one line at a time so that one bad line is one bad row.

The `datasets` library parses such files in blocks: a single line that is not UTF-8 or not JSON stops the
whole stream, hours into a run, and names the block's first row rather than the broken one. Read here, the
line becomes a `BadLine` that the row readers skip and count, or report, like any other malformed row.

A line is named by the byte offset of its first byte: a reader can start at any offset (a data-parallel
rank's share of the file, or a resumed position) without reading what comes before. Messages turn the
offset back into a row number (`row_number`): row N is line N + 1 of the file, and blank lines keep their
number but hold no row.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

_PEEK_BYTES = 1 << 16  # enough to find the first character of any real file
_COUNT_CHUNK = 1 << 20


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


def parse_line(raw: bytes, is_text: bool) -> Any:
    """A parsed object for a JSON line, {"text": line} for a .txt line, a BadLine, or None (a blank JSON line).

    A .txt line keeps everything but its line break ("\\n" or "\\r\\n"), as the `datasets` text builder does.
    """
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return BadLine(f"not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})")
    if is_text:
        return {"text": line.removesuffix("\n").removesuffix("\r")}
    if not line.strip():
        return None
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        return BadLine(f"not valid JSON ({e.msg} at column {e.colno})")


def line_start_at_or_after(f: IO[bytes], offset: int) -> int:
    """The offset of the first line that starts at `offset` or later (reads at most the line across it)."""
    if offset == 0:
        return 0
    f.seek(offset - 1)
    f.readline()  # the rest of the line holding byte offset-1; the next line starts at or after offset
    return f.tell()


def read_lines(path: Path, start: int = 0, end: int | None = None) -> Iterator[tuple[int, Any]]:
    """(offset, value) of the lines starting in [start, end) (`start` must be a line start); blank JSON lines
    are left out. The value is what `parse_line` makes of the line."""
    is_text = path.suffix == ".txt"
    with open(path, "rb") as f:
        f.seek(start)
        offset = start
        while end is None or offset < end:
            raw = f.readline()
            if not raw:
                return
            value = parse_line(raw, is_text)
            if value is not None:
                yield offset, value
            offset += len(raw)


def row_number(path: Path, offset: int) -> int:
    """The row (0-based line) number of the line starting at byte `offset`: the line breaks before it.

    Reads the file up to `offset`, so it is for messages only, never for the data path."""
    count, done = 0, 0
    with open(path, "rb") as f:
        while done < offset:
            chunk = f.read(min(_COUNT_CHUNK, offset - done))
            if not chunk:
                break
            count += chunk.count(b"\n")
            done += len(chunk)
    return count
