"""Pretraining text: documents -> tokens (BOS ... EOS) -> one stream -> fixed `seq_len` windows.

Rows are streamed one source per local file (so a bad row is reported by file and row number) or one
source for a hub dataset: JSON-lines and text files line by line here (titanium.data.lines, so a broken
line is one bad row), JSON arrays, parquet files and hub datasets through the `datasets` library.

Each data-parallel rank reads only its share of a line file: the byte ranges of titanium.data.shares,
read in turn, so it never parses another rank's lines and resumes by seeking to saved byte offsets. A
JSON array, parquet file or hub dataset is streamed whole by every rank, which keeps row i when
i % dp_world is its rank (the same rule with one row per range), and resumes from the stream's own
`state_dict` (the `datasets` library passes over earlier shards and record batches without making
rows). A rank's epoch ends when it has read its share of every source; it then starts again at its
share of the first. The position (epoch, source, offsets or row) and the tokens left over from the
last document are the dataset's state, so a resumed run sees exactly the next windows.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from titanium.config.sections import DataSection
from titanium.config.validate import looks_local
from titanium.data.json_array import JsonArrayStream
from titanium.data.lines import BadLine, first_character, read_lines, reads_by_line, row_number
from titanium.data.shares import LineShare, owned_ranges
from titanium.data.tokenizer import Tokenizer
from titanium.errors import UserError

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}


class DataError(UserError, ValueError):
    """A dataset row or file that cannot be used; the message names the file and row."""


@dataclass(frozen=True)
class Source:
    label: str  # file path or hub name, for messages
    builder: str  # datasets builder ("json", "parquet", "text") or hub dataset id
    data_files: str | None
    hub_config: str | None = None
    split: str = "train"
    flag: str = "--data.path"  # the option that named it, for messages
    by_line: bool = False  # read line by line here (titanium.data.lines) rather than through `datasets`

    def where(self, row: int) -> str:
        """How messages name a row: ``--data.path file.jsonl: row 12``.

        `row` is a row index, or for a line file the byte offset where the line starts (turned into its row
        number here, reading the file up to it: messages are rare)."""
        if self.by_line:
            assert self.data_files is not None
            row = row_number(Path(self.data_files), row)
        return f"{self.flag} {self.label}: row {row}"


def resolve_sources(cfg: DataSection, flag: str = "--data.path") -> list[Source]:
    """Local files (sorted, one source each) or a single hub dataset; errors name ``flag``."""
    if not looks_local(cfg.path):
        hub = Source(cfg.path, cfg.path, data_files=None, hub_config=cfg.hub_config, split=cfg.split, flag=flag)
        return [hub]
    path = Path(cfg.path).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in _BUILDERS)
    elif path.exists():
        files = [path]
    else:
        files = sorted(Path(".").glob(cfg.path)) if not path.is_absolute() else sorted(Path("/").glob(str(path)[1:]))
    if not files:
        raise DataError(f"{flag} {cfg.path}: no .json/.jsonl/.parquet/.txt files found")
    unknown = [f for f in files if f.suffix not in _BUILDERS]
    if unknown:
        raise DataError(f"{flag}: unsupported file type {unknown[0]} (use .json, .jsonl, .parquet or .txt)")
    for f in files:
        if f.stat().st_size == 0 or (f.suffix in (".json", ".jsonl") and first_character(f) is None):
            raise DataError(f"{flag} {f}: the file is empty; fill it, or remove it from {flag}")
    return [Source(str(f), _BUILDERS[f.suffix], str(f), flag=flag, by_line=reads_by_line(f)) for f in files]


def stream_rows(source: Source, start_row: int) -> Iterator[tuple[int, Any]]:
    """(row, value) pairs of one source from `start_row` on, read lazily; a broken line's value is a BadLine.

    A row is its index, or for a line file the byte offset where the line starts (`start_row` too)."""
    if source.by_line:
        assert source.data_files is not None
        yield from read_lines(Path(source.data_files), start_row)
        return
    ds = open_stream(source)
    yield from read_stream(source, ds.skip(start_row) if start_row else ds, start_row)


def open_stream(source: Source) -> datasets.IterableDataset | JsonArrayStream:
    """A source read through the `datasets` library (parquet, a hub dataset), streamed; a local JSON array is read
    whole by the ``json`` module (``json_array``: `datasets` would rewrite its mixed-type columns as JSON text)."""
    import datasets  # heavy import, only when such data is used

    if source.data_files is not None and Path(source.data_files).suffix == ".json":
        try:
            return JsonArrayStream(Path(source.data_files))
        except (OSError, ValueError) as e:
            raise DataError(f"{source.flag} {source.label}: cannot read it: {e}; fix the file") from e
    try:
        if source.data_files is None:
            return datasets.load_dataset(source.builder, name=source.hub_config, split=source.split, streaming=True)
        return datasets.load_dataset(source.builder, data_files=source.data_files, split="train", streaming=True)
    except Exception as e:  # the datasets library raises many types; all mean "cannot open"
        raise DataError(f"{source.flag} {source.label}: cannot open dataset: {e or type(e).__name__}") from e


def read_stream(source: Source, ds: datasets.IterableDataset, first_row: int) -> Iterator[tuple[int, Any]]:
    """(row, value) pairs of a stream whose first row is row `first_row` of the source."""
    row = first_row
    iterator = iter(ds)
    while True:
        try:
            item = next(iterator)
        except StopIteration:
            return
        except Exception as e:
            raise DataError(f"{source.where(row)}: cannot read it: {e}; fix the file") from e
        yield row, item
        row += 1


BROKEN_LINE_FIX = "fix or delete the line"


def bad_row_error(source: Source, row: int, problem: str, fix: str) -> DataError:
    """The error for a bad row under --data.on_bad_row fail: where it is, what is wrong, what to do."""
    return DataError(f"{source.where(row)}: {problem}; {fix}, or set --data.on_bad_row skip to skip such rows")


def check_same_dp_world(state: dict[str, Any], dp_world: int) -> None:
    """A data position is per data-parallel rank: it cannot be carried to another DP degree."""
    if state["dp_world"] != dp_world:
        raise DataError(
            f"the saved data position is for {state['dp_world']} data-parallel ranks, this run has {dp_world}; "
            "keep the data-parallel degree, or restart the data with "
            "--checkpoint.exclude_from_loading data rng"
        )


IMAGE_COLUMNS = ("images", "image")
"""The columns TRL's vision trainers read a row's images from."""


def refuse_images(item: Any, source: Source, row: int) -> None:
    """``DataError`` for a row that carries images (a non-empty ``images``, or an ``image``), read for a text model."""
    if not isinstance(item, dict):
        return
    column = next((c for c in IMAGE_COLUMNS if item.get(c) not in (None, [], "")), None)
    if column is not None:
        raise DataError(
            f"{source.where(row)} has images (its '{column}' column), but the model reads text only: start from an "
            "image-text model's folder (its config.json and processor), or drop the images from the data"
        )


class RowReader:
    """This rank's rows of every source, from a saved position on, looping over epochs.

    The base of the text and SFT datasets: it owns the position (epoch, source, offsets or row), the
    data-parallel split and the bad-row policy, so both resume and report problems the same way.

    A row with images (TRL's ``images`` or ``image`` column) stops a reader that does not read them
    (``reads_images``: an image-text model's readers set it): training a text model on such rows would drop
    their images without a word.
    """

    reads_images = False

    def __init__(self, cfg: DataSection, dp_rank: int = 0, dp_world: int = 1) -> None:
        self.cfg, self.dp_rank, self.dp_world = cfg, dp_rank, dp_world
        self.shards = cfg.shards or dp_world
        if self.shards % dp_world:
            raise DataError(
                f"--data.shards {cfg.shards} must be a multiple of the data-parallel degree {dp_world}; "
                f"use {dp_world * max(1, cfg.shards // dp_world)}, or 0 (one byte range per rank)"
            )
        self.sources = resolve_sources(cfg)
        self.epoch = 0
        self.source_idx = 0
        self.next_row = 0  # next row of sources[source_idx] to read (sources read through `datasets`)
        self.share: LineShare | None = None  # this rank's position in sources[source_idx] (line files)
        self.stream: datasets.IterableDataset | JsonArrayStream | None = None  # sources[source_idx] not read by line
        self._stream_state: dict[str, Any] | None = None  # where a resumed `stream` starts
        self.bad_rows = 0
        self._pass_used = False  # did the current pass give the consumer anything?

    def _rows(self) -> Iterator[tuple[Source, int, Any]]:
        """(source, row, row value) for this rank; a subclass marks `_pass_used` when a row gave it something."""
        full_pass = self.source_idx == 0 and self.next_row == 0 and self.share is None
        self._pass_used = False
        while True:
            while self.source_idx < len(self.sources):
                source = self.sources[self.source_idx]
                for row, item in self._source_rows(source):
                    if isinstance(item, BadLine):
                        self._bad_row(source, row, item.problem, BROKEN_LINE_FIX)
                    else:
                        if not self.reads_images:
                            refuse_images(item, source, row)
                        yield source, row, item
                self.source_idx += 1
                self.next_row, self.share, self.stream, self._stream_state = 0, None, None, None
            if full_pass and not self._pass_used:  # looping on would never yield anything
                why = "; ".join(self._unused_rows()) or "no row gave a sample"
                raise DataError(
                    f"--data.path {self.cfg.path}: a whole pass gave data-parallel rank {self.dp_rank} of "
                    f"{self.dp_world} nothing to train on ({why}); with fewer rows than data-parallel ranks, "
                    "use more rows"
                )
            full_pass, self._pass_used = True, False
            self.epoch += 1
            self.source_idx = 0
            logger.info("data: finished pass over %s; starting epoch %d", self.cfg.path, self.epoch)

    def _unused_rows(self) -> list[str]:
        """Why rows gave nothing, each with its count and what to change: the error of a pass that gave nothing
        names them. A subclass that leaves rows out for its own reasons (too long) adds those."""
        fix = "check the file's columns (--data.kind and the column options)"
        return [f"{self.bad_rows} bad rows skipped: {fix}"] if self.bad_rows else []

    def _source_rows(self, source: Source) -> Iterator[tuple[int, Any]]:
        """This rank's rows of one source from the position on: its byte ranges of a line file, else every
        dp_world-th row of the stream."""
        if source.by_line:
            if self.share is None:
                self.share = LineShare(Path(source.label), self._ranges(Path(source.label)))
            yield from self.share
            return
        self.stream = open_stream(source)
        if self._stream_state is not None:  # the library passes over earlier shards and record batches
            self.stream.load_state_dict(self._stream_state)
        for row, item in read_stream(source, self.stream, self.next_row):
            self.next_row = row + 1
            if row % self.dp_world == self.dp_rank:
                yield row, item

    def _ranges(self, path: Path) -> list[tuple[int, int]]:
        return owned_ranges(path.stat().st_size, self.shards, self.dp_rank, self.dp_world)

    def _bad_row(self, source: Source, row: int, problem: str, fix: str) -> None:
        """Skip (counted, the first few logged) or stop, per --data.on_bad_row."""
        if self.cfg.on_bad_row == "fail":
            raise bad_row_error(source, row, problem, fix)
        self.bad_rows += 1
        if self.bad_rows <= 5:
            logger.warning("skipping bad row: %s: %s", source.where(row), problem)

    def _text_of(self, item: Any, source: Source, row: int) -> str | None:
        column = self.cfg.text_column
        if not isinstance(item, dict) or column not in item:
            problem = f"no '{column}' column (columns: {sorted(item) if isinstance(item, dict) else type(item)})"
        elif item[column] is None:
            problem = f"'{column}' is missing or null"
        elif not isinstance(item[column], str):
            problem = f"'{column}' is {type(item[column]).__name__}, not a string"
        else:
            return item[column]
        self._bad_row(source, row, problem, "fix the row or set --data.text_column")
        return None

    def _position(self) -> dict[str, Any]:
        share = None
        if self.share is not None:
            share = {"offsets": self.share.offsets, "turn": self.share.turn, "size": self.share.path.stat().st_size}
        return {
            "epoch": self.epoch,
            "source_idx": self.source_idx,
            "next_row": self.next_row,
            # JSON strings: DCP would flatten a nested structure into keys that must match at load.
            "share": json.dumps(share),
            "stream": json.dumps(self.stream.state_dict() if self.stream is not None else self._stream_state),
            "bad_rows": self.bad_rows,
            "sources": [s.label for s in self.sources],
            "dp_world": self.dp_world,
            "shards": self.shards,
        }

    def _load_position(self, state: dict[str, Any]) -> None:
        check_same_dp_world(state, self.dp_world)
        if state["sources"] != [s.label for s in self.sources]:
            raise DataError(
                "the checkpoint's data position is for other files "
                f"({state['sources'][:3]}...) than --data.path {self.cfg.path}; "
                "resume with the same data, or start without the dataloader state"
            )
        if state["shards"] != self.shards:
            raise DataError(
                f"the saved data position is for --data.shards {state['shards']}, this run has {self.shards}; "
                "keep --data.shards, or restart the data with --checkpoint.exclude_from_loading data rng"
            )
        self.epoch, self.source_idx, self.next_row = state["epoch"], state["source_idx"], state["next_row"]
        self.bad_rows = state["bad_rows"]
        self.stream, self._stream_state = None, json.loads(state["stream"])
        share = json.loads(state["share"])
        self.share = None
        if share is not None:
            path = Path(self.sources[self.source_idx].label)
            if path.stat().st_size != share["size"]:
                raise DataError(
                    f"--data.path {path}: the file changed size since the checkpoint ({share['size']} -> "
                    f"{path.stat().st_size} bytes), so the saved byte offsets no longer name its rows; resume with "
                    "the same data, or restart the data with --checkpoint.exclude_from_loading data rng"
                )
            self.share = LineShare(path, self._ranges(path), share["offsets"], share["turn"])


class TextDataset(RowReader):
    """Infinite, resumable stream of {"input", "label"} windows of `seq_len` tokens for one DP rank."""

    def __init__(
        self, cfg: DataSection, tokenizer: Tokenizer, seq_len: int, dp_rank: int = 0, dp_world: int = 1
    ) -> None:
        super().__init__(cfg, dp_rank, dp_world)
        self.tokenizer, self.seq_len = tokenizer, seq_len
        self.buffer: list[int] = []

    def _documents(self) -> Iterator[str]:
        """This rank's document texts from the saved position on, looping over epochs."""
        for source, row, item in self._rows():
            text = self._text_of(item, source, row)
            if text is not None:
                self._pass_used = True
                yield text

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        documents = self._documents()
        while True:
            while len(self.buffer) <= self.seq_len:
                self.buffer.extend(self.tokenizer.encode(next(documents), bos=True, eos=True))
            window = torch.tensor(self.buffer[: self.seq_len + 1], dtype=torch.long)
            # The window's last token is the next window's first input: no token pair is lost.
            self.buffer = self.buffer[self.seq_len :]
            yield {"input": window[:-1], "label": window[1:]}

    def state_dict(self) -> dict[str, Any]:
        return {**self._position(), "buffer": list(self.buffer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_position(state)
        self.buffer = list(state["buffer"])
