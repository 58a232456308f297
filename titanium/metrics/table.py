"""Rows of samples logged beside the scalars, e.g. GRPO's completions with their rewards and advantages.

An objective hands the loop a ``Table`` on the steps it chooses (``Objective.tables``); the loop prints it on the
console (rank 0) and ``MetricsLogger.log_table`` writes it to TensorBoard (a markdown table under the Text tab)
and W&B (a ``wandb.Table``). Long texts are cut for the console only: TensorBoard and W&B get them whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

CONSOLE_WIDTH = 48
"""Characters of a text cell on the console (the rest is cut, with an ellipsis)."""


@dataclass(frozen=True)
class Table:
    columns: tuple[str, ...]
    rows: Sequence[tuple[Any, ...]]
    cut_from_start: tuple[str, ...] = ()
    """Columns whose long texts keep their end on the console (a prompt: its question comes last)."""

    def __post_init__(self) -> None:
        assert all(len(row) == len(self.columns) for row in self.rows), "every row has a value per column"

    def text(self, width: int = CONSOLE_WIDTH) -> str:
        """Aligned plain-text columns: numbers to 4 significant digits, texts on one line, cut to ``width``."""
        from_start = [name in self.cut_from_start for name in self.columns]
        cells = [list(self.columns)] + [[_cell(v, width, s) for v, s in zip(row, from_start)] for row in self.rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.columns))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def markdown(self) -> str:
        """A markdown table (TensorBoard's Text tab renders it), every text whole."""
        head = "| " + " | ".join(self.columns) + " |"
        rule = "|" + "---|" * len(self.columns)
        body = ["| " + " | ".join(_markdown_cell(v) for v in row) + " |" for row in self.rows]
        return "\n".join([head, rule, *body])


def _number(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return f"{value:.4g}"


def _cell(value: Any, width: int, from_start: bool) -> str:
    number = _number(value)
    if number is not None:
        return number
    text = " ".join(str(value).replace("\n", " ⏎ ").split())
    if len(text) <= width:
        return text
    return "…" + text[1 - width :] if from_start else text[: width - 1] + "…"


def _markdown_cell(value: Any) -> str:
    number = _number(value)
    if number is not None:
        return number
    return str(value).replace("|", "\\|").replace("\n", "<br>")
