"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import pytest
import torch.distributed


@pytest.fixture
def no_process_group(monkeypatch):
    """Fail the test if anything creates a process group."""

    def refuse(*args, **kwargs):
        raise AssertionError("a process group was created before the config was checked")

    monkeypatch.setattr(torch.distributed, "init_process_group", refuse)


@pytest.fixture(scope="session")
def pretrained_folder(tmp_path_factory):
    """Where tests/e2e/chain.py's pretrained checkpoints live for the session (each made once)."""
    return tmp_path_factory.mktemp("chain")
