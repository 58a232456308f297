"""vLLM's per-layer "not loaded" warnings of a block-by-block weight sync are dropped while titanium reloads a block,
and nothing else is: its other warnings pass, and outside a reload those messages pass too. (Plain logging: runs
without vLLM; tests/vllm checks a real GRPO run's log.)"""

from __future__ import annotations

import logging

import pytest

from titanium.generation.vllm_engine import RELOAD_LOGGERS, quiet_partial_reload

LAYERWISE, INPLACE = (logging.getLogger(name) for name in RELOAD_LOGGERS)


def _log_all() -> None:
    LAYERWISE.warning("%s: Failed to load weights", "QKVParallelLinear")
    INPLACE.warning("Following weights were not loaded from checkpoint: %s", {"model.norm.weight"})
    LAYERWISE.warning("%s: something else went wrong", "RMSNorm")
    logging.getLogger("vllm.other").warning("%s: Failed to load weights", "elsewhere")


def test_only_the_partial_reload_warnings_are_dropped_and_only_during_a_reload(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING):
        with quiet_partial_reload():
            _log_all()
        during = [r.getMessage() for r in caplog.records]
        caplog.clear()
        _log_all()
        after = [r.getMessage() for r in caplog.records]
    assert during == ["RMSNorm: something else went wrong", "elsewhere: Failed to load weights"]
    assert len(after) == 4 and "QKVParallelLinear: Failed to load weights" in after
    assert not LAYERWISE.filters and not INPLACE.filters
