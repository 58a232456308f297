"""Skip the tests marked ``peers`` where the peers of ``benchmarks/peers.py`` are not installed (CI does not install
them). To run them, a virtualenv beside the main one with the peers' wheels (see tests/peers/test_peers.py)."""

from __future__ import annotations

import importlib.util

import pytest

PEERS = ("torchtune", "torchtitan", "trl", "triton")


def pytest_collection_modifyitems(config, items):
    missing = [name for name in PEERS if importlib.util.find_spec(name) is None]
    if not missing:
        return
    skip = pytest.mark.skip(
        reason=f"needs the peers of benchmarks/peers.py ({', '.join(missing)} missing; marked peers)"
    )
    for item in items:
        if item.get_closest_marker("peers") is not None:
            item.add_marker(skip)
