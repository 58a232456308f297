"""The test suite itself: pytest imports test files by basename (rootdir-relative, no packages), so two
test files with the same name in different folders stop the whole run at collection; and CUDA-only tests carry
the ``cuda`` mark, which ``pytest -m cuda`` (the GPU suite) selects."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_file_names_are_unique():
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert not [name for name, count in names.items() if count > 1]


def test_cuda_only_tests_use_the_cuda_mark():
    """A bare skipif on ``torch.cuda.is_available()`` would hide a test from ``pytest -m cuda``; the ``cuda`` mark
    skips it the same way where no GPU is present (tests/conftest.py)."""
    bare = re.compile(r"skipif\(\s*not torch\.cuda\.is_available\(\)")
    offenders = [str(path.relative_to(TESTS)) for path in TESTS.rglob("*.py") if bare.search(path.read_text())]
    assert not offenders, f"use @pytest.mark.cuda instead of a skipif on torch.cuda.is_available() in {offenders}"
