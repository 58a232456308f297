"""A data-parallel rank's share of a local line file (.jsonl, .txt): byte ranges read in turn.

A file of S bytes is cut into n = ``--data.shards`` ranges, range k being bytes [k*S//n, (k+1)*S//n); a line
belongs to the range holding its first byte. Rank r of W data-parallel ranks (W divides n) owns ranges
r, r + W, r + 2W, ... and reads them in turn, one line from each (round robin), passing over ranges it has
finished. So a rank opens the file where its ranges start and never reads another rank's lines (at most the
end of the one line that crosses into its range, to find where the next line starts).

One process (W = 1) reads all n ranges in turn; W ranks read the same lines in the same turns, split between
them, so with the same n the rows of a step are the same at any data-parallel degree dividing n, until the
first range runs out (a short range, or one without any line start, drops out of the turns earlier on one
layout than on another). The position is one byte offset per owned range and whose turn it is: resuming seeks
there, without reading earlier lines.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from titanium.data.lines import line_start_at_or_after, parse_line


def owned_ranges(size: int, shards: int, rank: int, world: int) -> list[tuple[int, int]]:
    """The byte ranges [start, end) of a file of `size` bytes that data-parallel rank `rank` of `world` reads."""
    assert shards % world == 0, (shards, world)
    return [(k * size // shards, (k + 1) * size // shards) for k in range(rank, shards, world)]


class LineShare:
    """The lines of one file in a rank's ranges, round robin; ``offsets`` and ``turn`` are the position.

    ``offsets[k]``: where the next line of owned range k starts (>= its end when the range is finished);
    ``turn``: the owned range that gives the next line.
    """

    def __init__(self, path: Path, ranges: list[tuple[int, int]], offsets: list[int] | None = None, turn: int = 0):
        self.path, self.ranges, self.turn = path, ranges, turn
        if offsets is None:
            with open(path, "rb") as f:
                offsets = [min(line_start_at_or_after(f, start), end) for start, end in ranges]
        self.offsets = offsets

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        """(offset, value) of each line in turn (values as ``parse_line``; blank JSON lines left out)."""
        is_text = self.path.suffix == ".txt"
        ends = [end for _, end in self.ranges]
        with ExitStack() as stack:
            files = [stack.enter_context(open(self.path, "rb")) for _ in self.ranges]
            for f, offset in zip(files, self.offsets):
                f.seek(offset)
            while any(o < e for o, e in zip(self.offsets, ends)):
                k = self.turn
                self.turn = (k + 1) % len(self.ranges)
                if self.offsets[k] >= ends[k]:
                    continue
                offset, raw = self.offsets[k], files[k].readline()
                self.offsets[k] = offset + len(raw) if raw else ends[k]
                value = parse_line(raw, is_text) if raw else None
                if value is not None:
                    yield offset, value
