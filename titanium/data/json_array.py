"""A local ``.json`` file holding one JSON array of rows, read whole with the ``json`` module.

The ``datasets`` library infers one Arrow schema for all the rows of such a file, and a column whose values differ in
type from row to row is turned into JSON text: a chat row whose message ``content`` is a string in one row and a
list of content parts in another (TRL's format for rows with images) came back as ``'"hi"'`` and
``'[{"type": "image"}, ...]'``, so text rows trained on quoted strings and image rows were skipped. Here each row is
exactly the JSON value it is in the file. Such files are read whole by ``datasets`` too (a JSON array cannot be
streamed); this stream keeps the interface the row readers use (``skip``, ``state_dict``, ``load_state_dict``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class JsonArrayStream:
    """The rows of a JSON array file from a position on; ``ValueError`` when the file is not one JSON array."""

    def __init__(self, path: Path, start: int = 0) -> None:
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a JSON array: {e}") from e
        if not isinstance(rows, list):
            raise ValueError(f"holds a JSON {type(rows).__name__}, not an array of rows")
        self.rows, self.next = rows, start

    def __iter__(self) -> Iterator[Any]:
        while self.next < len(self.rows):
            self.next += 1
            yield self.rows[self.next - 1]

    def skip(self, rows: int) -> JsonArrayStream:
        stream = JsonArrayStream.__new__(JsonArrayStream)
        stream.rows, stream.next = self.rows, self.next + rows
        return stream

    def state_dict(self) -> dict[str, int]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next = int(state["next"])
