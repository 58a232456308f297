"""The transformers backend's compatibility matrix (``python -m tests.backend_matrix``), in CI: the one-process cells
of the most-downloaded families, measured now in this one process, are not worse than the committed matrix
(``tests/backend_matrix/matrix.json``) says; the table in docs/models.md is that matrix's; and at least 25 model
types pass load, step, logits, gradients, FSDP 2 and LoRA. The layout cells of a few of them are
tests/distributed/test_backend_matrix_layouts.py; the full sweep over every causal LM is the script."""

from __future__ import annotations

import logging

import pytest

from tests.backend_matrix.cells import SINGLE_CELLS, YES, single_process_cells
from tests.backend_matrix.table import FAMILIES, doc_table, load_matrix, render, rows, worse_cells

transformers = pytest.importorskip("transformers")

PASSING = ("load", "step", "logits", "grads", "fsdp", "lora")


def test_the_doc_table_is_the_committed_matrix() -> None:
    matrix = load_matrix()
    assert matrix["transformers"] == transformers.__version__, "the installed transformers changed: rerun the script"
    assert doc_table() == render(matrix), "docs/models.md: rerun python -m tests.backend_matrix --write"


def test_at_least_25_families_pass_the_core_cells() -> None:
    table = rows(load_matrix())
    passing = sorted(mt for mt, row in table.items() if all(row[c].status == YES for c in PASSING))
    assert len(passing) >= 25, passing
    assert len(set(FAMILIES.values()) & set(passing)) >= 25, sorted(set(FAMILIES.values()) - set(passing))


def test_the_families_are_not_worse_than_committed() -> None:
    logging.disable(logging.WARNING)
    transformers.logging.set_verbosity_error()
    committed = rows(load_matrix())
    worse = {}
    for model_type in FAMILIES.values():
        now = single_process_cells(model_type)
        was = {name: committed[model_type][name] for name in SINGLE_CELLS}
        if problems := worse_cells(was, now):
            worse[model_type] = problems
    assert not worse, worse
