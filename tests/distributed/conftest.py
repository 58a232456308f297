"""Fixtures of the multi-process tests."""

from __future__ import annotations

import pytest

from tests.distributed.parity import Run, single_process_run


@pytest.fixture(scope="session")
def single_process_reference(tmp_path_factory) -> Run:
    """The one-process run every parity test compares against (made once per session)."""
    return single_process_run(tmp_path_factory.mktemp("reference"))
