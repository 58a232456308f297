"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import pytest
import torch.distributed

from tests.e2e.chain import start


@pytest.fixture
def no_process_group(monkeypatch):
    """Fail the test if anything creates a process group."""

    def refuse(*args, **kwargs):
        raise AssertionError("a process group was created before the config was checked")

    monkeypatch.setattr(torch.distributed, "init_process_group", refuse)


@pytest.fixture(scope="session")
def pretrained_folder(tmp_path_factory):
    """Where tests/e2e/chain.py's runs live for the session (each made once)."""
    return tmp_path_factory.mktemp("chain")


@pytest.fixture(scope="session")
def post_trained(pretrained_folder):
    """kind -> (dump folder, run) of tests/e2e/chain.py's DPO and GRPO runs (seed 0), started together the first
    time a test asks for either; a run no test waited for is stopped when the session ends."""
    runs = {kind: start(kind, pretrained_folder) for kind in ("dpo", "grpo")}
    yield runs
    for _, run in runs.values():
        run.stop()
