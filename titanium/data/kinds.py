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
from titanium.config.validate import looks_local
from titanium.data.text import DataError, resolve_sources, stream_rows

_ROWS_LOOKED_AT = 32
"""Rows read to find one that is an object (a file may start with blank or broken lines)."""


def detect_kind(cfg: DataSection, rows: str) -> tuple[str, str]:
    """The kind (``chat``, ``preference``, ``unpaired``, ``instruct`` or ``text``) of ``cfg``'s data and why, for the
    start-up line. ``rows``: what a row is to the objective (``Needs.rows``); documents are text whatever the
    columns."""
    if rows == "documents":
        return "text", "the objective reads documents"
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


def first_row(cfg: DataSection) -> tuple[Mapping, str]:
    """The first row of ``cfg``'s data that is an object, and where it was found."""
    source = resolve_sources(cfg)[0]
    for _, value in islice(stream_rows(source, 0), _ROWS_LOOKED_AT):
        if isinstance(value, Mapping):
            return value, source.label
    raise DataError(
        f"--data.kind auto: the first {_ROWS_LOOKED_AT} rows of {source.label} hold no JSON object with columns; "
        "fix the file or set --data.kind"
    )


def first_columns(cfg: DataSection) -> tuple[set[str], str]:
    """The columns (not null) of the first row of ``cfg``'s data that is an object, and where it was found."""
    row, where = first_row(cfg)
    return {k for k, v in row.items() if v is not None}, where


STRING_RULES = {
    "samples": "string prompt/completion rows are plain text, as in TRL (rows of messages go through the chat "
    "template)",
    "preference": "string prompt/chosen/rejected rows become a user turn and assistant answers in the chat template "
    "(TRL reads them as plain text; --chat.chat_template none does so here)",
    "prompts": "a string prompt becomes one user message in the chat template (TRL reads it as plain text; "
    "--data.kind text --data.text_column prompt does so here)",
}
"""What a string row means, by what a row is to the objective (``Needs.rows``; pairs: "preference"). Not TRL's one
rule (strings are plain text everywhere) because titanium's preference and prompt data follow a chat model's SFT,
whose format they must keep: the same string read as plain text would train a chat model on text it never sees when
served; the start-up line says which rule applies and how to get TRL's."""


def string_rule(cfg: DataSection, rows: str, chat_template: str) -> str | None:
    """The start-up line on what the data's strings mean to an objective whose rows are ``rows`` (``Needs.rows``),
    when the first row holds strings. Local files only: a hub dataset's first row would cost a download (and fail
    offline: a dry run reads no data) for a line of the log."""
    if cfg.kind == "synthetic" or rows == "documents" or not looks_local(cfg.path):
        return None
    try:
        row, _ = first_row(cfg)
    except DataError:
        return None  # (an empty or unreadable file: its reader says so, after the config's own checks)
    if not isinstance(row.get(cfg.prompt_column), str):
        return None
    if rows == "samples":
        return STRING_RULES["samples"] if isinstance(row.get(cfg.completion_column), str) else None
    if chat_template == "none" or cfg.kind == "text":
        return "string rows are plain text, as in TRL"
    if cfg.kind in ("preference", "unpaired"):
        return STRING_RULES["preference"]
    return STRING_RULES["prompts"] if cfg.kind == "chat" else None


def has_column(cfg: DataSection, column: str) -> bool:
    """Whether the first row of ``cfg``'s data has ``column`` (not null)."""
    return column in first_columns(cfg)[0]
