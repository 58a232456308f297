"""The bundled corpus is present, well formed and within its size budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CORPUS = Path(__file__).resolve().parents[2] / "assets/corpus"
FILES = ["train.jsonl", "validation.jsonl"]


@pytest.mark.parametrize("name", FILES)
def test_lines_are_json_with_text(name: str) -> None:
    path = CORPUS / name
    assert path.is_file(), f"{path} missing: run scripts/make_corpus.py"
    n = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            row = json.loads(line)
            assert isinstance(row, dict), f"{name}:{lineno}"
            assert isinstance(row.get("text"), str) and row["text"].strip(), f"{name}:{lineno}"
            n += 1
    assert n >= 50


def test_total_size_and_split() -> None:
    sizes = {name: (CORPUS / name).stat().st_size for name in FILES}
    total = sum(sizes.values())
    assert 1.5e6 <= total <= 4e6, sizes
    assert 0.02 <= sizes["validation.jsonl"] / total <= 0.1, sizes


def test_readme_present() -> None:
    assert (CORPUS / "README.md").is_file()
