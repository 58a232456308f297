"""The layout cells of the compatibility matrix for representative architectures, in CI: FSDP 2, TP 2 and PP 2 of a
dense Llama, a Gemma 3 (sliding windows, tied embeddings), a Qwen3-MoE and a DeepSeek-V3 (latent attention, grouped
routing with titanium's bias, shared experts) trained by ``titanium.train`` 2 steps against one process, each cell
not worse than the committed matrix; and expert parallelism 2 of both MoE models (their blocks are titanium's MoE),
whose losses equal one process's. One launch of one process and one of two for everything
(tests/backend_matrix/layouts.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.backend_matrix.cells import YES
from tests.backend_matrix.layouts import EXPERT_PARALLEL, LAYOUTS, layout_cells
from tests.backend_matrix.table import load_matrix, rows, worse_cells

pytest.importorskip("transformers")

REPRESENTATIVE = ["llama", "gemma3_text", "qwen3_moe", "deepseek_v3"]
EXPERTS = {"qwen3_moe": {"ep": EXPERT_PARALLEL}, "deepseek_v3": {"ep": EXPERT_PARALLEL}}


def test_layouts_of_representative_architectures(tmp_path: Path) -> None:
    committed = rows(load_matrix())
    measured = layout_cells(REPRESENTATIVE, tmp_path, timeout=900, extra=EXPERTS)
    worse = {}
    for model_type, cells in measured.items():
        was = {name: committed[model_type][name] for name in LAYOUTS}
        if problems := worse_cells(was, cells):
            worse[model_type] = problems
    assert not worse, worse
    for model_type in EXPERTS:
        assert measured[model_type]["ep"].status == YES, measured[model_type]["ep"]
