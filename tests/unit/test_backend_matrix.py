"""The transformers backend's compatibility matrix (``python -m tests.backend_matrix``): the one-process cells of the
most-downloaded families, measured now in this one process, are not worse than the committed matrix
(``tests/backend_matrix/matrix.json``) says (``IN_CI`` of them in the default suite, all with ``-m backend_matrix``);
the table in docs/models.md is that matrix's; and at least 25 of the families pass load, step, logits, gradients,
FSDP 2 and LoRA in it. The layout cells of a few of them are tests/distributed/test_backend_matrix_layouts.py; the
full sweep over every causal LM is the script."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from tests.backend_matrix.cells import SINGLE_CELLS, YES, single_process_cells
from tests.backend_matrix.table import FAMILIES, doc_table, load_matrix, render, rows, worse_cells

transformers = pytest.importorskip("transformers")

PASSING = ("load", "step", "logits", "grads", "fsdp", "lora")
IN_CI = {"llama", "gemma3_text", "qwen3_5_text", "qwen3_moe", "deepseek_v3", "gpt_oss", "granite", "phi3"}
"""The families measured in the default suite, one of each way the backend builds a model (dense; sliding windows,
soft-capping and tied embeddings; linear attention; titanium's MoE with softmax, and with sigmoid group routing
under latent attention; its own attention and MoE; scaling multipliers; fused projections). The others are marked
``backend_matrix``, which the default run deselects (pyproject.toml): ``pytest -m backend_matrix`` runs them."""


@pytest.fixture
def quiet() -> Iterator[None]:
    """Without the warnings of building 30 architectures (and restored after: other tests read the logs)."""
    verbosity = transformers.logging.get_verbosity()
    logging.disable(logging.WARNING)
    transformers.logging.set_verbosity_error()
    yield
    logging.disable(logging.NOTSET)
    transformers.logging.set_verbosity(verbosity)


def test_the_doc_table_is_the_committed_matrix() -> None:
    matrix = load_matrix()
    assert matrix["transformers"] == transformers.__version__, "the installed transformers changed: rerun the script"
    assert doc_table() == render(matrix), "docs/models.md: rerun python -m tests.backend_matrix --write"


def test_at_least_25_families_pass_the_core_cells() -> None:
    table = rows(load_matrix())
    passing = sorted(mt for mt, row in table.items() if all(row[c].status == YES for c in PASSING))
    assert len(set(FAMILIES.values()) & set(passing)) >= 25, sorted(set(FAMILIES.values()) - set(passing))


@pytest.mark.parametrize(
    "model_type",
    [mt if mt in IN_CI else pytest.param(mt, marks=pytest.mark.backend_matrix) for mt in FAMILIES.values()],
)
def test_the_families_are_not_worse_than_committed(model_type: str, quiet: None) -> None:
    committed = rows(load_matrix())[model_type]
    now = single_process_cells(model_type)
    assert not worse_cells({name: committed[name] for name in SINGLE_CELLS}, now)
