"""The transformers backend's compatibility matrix over every causal-LM ``model_type`` the installed ``transformers``
knows: ``python -m tests.backend_matrix`` prints it; ``--write`` stores it in ``tests/backend_matrix/matrix.json`` and
writes its table into ``docs/models.md``. ``--types a b`` measures those model types only (with ``--write``, their
rows replace the committed ones). The one-process cells run in this process, the layout cells in two launches
(``layouts.py``). The full sweep takes about half an hour on 2 CPU cores; CI runs the families' cells only
(``tests/unit/test_backend_matrix.py``, ``tests/distributed/test_backend_matrix_layouts.py``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

from tests.backend_matrix.cells import CELLS, UNTESTED, YES, Cell, single_process_cells
from tests.backend_matrix.layouts import layout_cells
from tests.backend_matrix.table import MATRIX, load_matrix, render, write_doc


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def measure(model_types: list[str], layouts: bool = True) -> dict[str, dict[str, Cell]]:
    out = {}
    for mt in model_types:
        start = time.monotonic()
        out[mt] = single_process_cells(mt)
        print(f"{mt}: {' '.join(c.status for c in out[mt].values())} ({time.monotonic() - start:.1f} s)", flush=True)
    trained = [mt for mt, row in out.items() if row["load"].status == YES and row["step"].status == YES]
    layout = {}
    if layouts and trained:
        with tempfile.TemporaryDirectory() as folder:
            layout = layout_cells(trained, Path(folder))
    for mt, row in out.items():
        cells = layout.get(mt) or {
            name: Cell(UNTESTED, "the model does not train in one process") for name in ("fsdp", "tp", "pp")
        }
        if not layouts:
            cells = {name: Cell(UNTESTED, "not measured") for name in cells}
        out[mt] = {name: (row.get(name) or cells[name]) for name in CELLS}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.backend_matrix", description=__doc__)
    parser.add_argument("--types", nargs="*", help="model types to measure (default: every causal LM)")
    parser.add_argument("--write", action="store_true", help="store matrix.json and the table in docs/models.md")
    parser.add_argument("--no-layouts", action="store_true", help="skip the FSDP/TP/PP launches")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    import transformers

    transformers.logging.set_verbosity_error()
    measured = measure(args.types or causal_lm_types(), layouts=not args.no_layouts)
    matrix = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "command": "python -m tests.backend_matrix --write",
        "rows": {},
    }
    if args.types and MATRIX.exists():
        matrix = {**load_matrix(), **{k: v for k, v in matrix.items() if k != "rows"}}
    matrix["rows"].update({mt: {name: cell.to_json() for name, cell in row.items()} for mt, row in measured.items()})
    matrix["rows"] = dict(sorted(matrix["rows"].items()))
    if args.write:
        import json

        MATRIX.write_text(json.dumps(matrix, indent=1, ensure_ascii=False) + "\n")
        write_doc(matrix)
    else:
        print(render({**matrix, "rows": {mt: matrix["rows"][mt] for mt in measured}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
