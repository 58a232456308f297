"""``--data.kind auto``: the kind of data a dataset holds, told from its columns as TRL tells its dataset formats.

TRL users never name a format: a ``messages`` column is a conversation, ``prompt`` + ``completion`` a
prompt/completion pair, ``chosen`` + ``rejected`` a preference pair, ``completion`` + ``label`` an unpaired
(KTO) row, ``text`` plain text. The first rows of the first file (or of the hub dataset's stream) are read; the
column names are the ``[data]`` ``*_column`` options, so renamed columns are found too.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import islice

from titanium.config.sections import DataSection
from titanium.data.text import DataError, resolve_sources, stream_rows

_ROWS_LOOKED_AT = 32
"""Rows read to find one that is an object (a file may start with blank or broken lines)."""


def detect_kind(cfg: DataSection, objective: str) -> tuple[str, str]:
    """The kind (``chat``, ``preference``, ``unpaired``, ``instruct`` or ``text``) of ``cfg``'s data and why, for the
    start-up line. Pretraining reads text whatever the columns."""
    if objective == "pretrain":
        return "text", "pretraining reads documents"
    columns, where = first_columns(cfg)
    has = columns.__contains__
    rules = (
        ((cfg.chosen_column, cfg.rejected_column), "preference"),
        ((cfg.completion_column, cfg.label_column), "unpaired"),
        ((cfg.messages_column,), "chat"),
        ((cfg.prompt_column, cfg.completion_column), "chat"),
        ((cfg.instruction_column, cfg.output_column), "instruct"),
        ((cfg.prompt_column,), "chat"),
        ((cfg.instruction_column,), "instruct"),
        ((cfg.text_column,), "text"),
    )
    for needed, kind in rules:
        if all(map(has, needed)):
            return kind, f"the {' and '.join(repr(c) for c in needed)} column{'s' * (len(needed) > 1)} of {where}"
    raise DataError(
        f"--data.kind auto: cannot tell what {where} holds from its columns ({', '.join(sorted(columns))}): rows "
        "hold 'messages', 'prompt' and 'completion', 'chosen' and 'rejected', 'completion' and 'label', "
        "'instruction' and 'output', or 'text'; set --data.kind and point the --data.*_column options at yours"
    )


def first_columns(cfg: DataSection) -> tuple[set[str], str]:
    """The columns of the first row of ``cfg``'s data that is an object, and where it was found."""
    source = resolve_sources(cfg)[0]
    for _, value in islice(stream_rows(source, 0), _ROWS_LOOKED_AT):
        if isinstance(value, Mapping):
            return {k for k, v in value.items() if v is not None}, source.label
    raise DataError(
        f"--data.kind auto: the first {_ROWS_LOOKED_AT} rows of {source.label} hold no JSON object with columns; "
        "fix the file or set --data.kind"
    )


def has_column(cfg: DataSection, column: str) -> bool:
    """Whether the first row of ``cfg``'s data has ``column`` (not null)."""
    return column in first_columns(cfg)[0]
