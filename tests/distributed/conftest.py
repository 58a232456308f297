"""Fixtures of the multi-process tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.parity import Run, layout_runs, single_process_run


@pytest.fixture(scope="session")
def single_process_reference(tmp_path_factory) -> Run:
    """The one-process run every parity test compares against (made once per session)."""
    return single_process_run(tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="session")
def four_process_runs(tmp_path_factory) -> dict[str, tuple[Run, Path]]:
    """name -> (run, its folder) of every 4-process job of the layout tests, all in one launch (a torchrun start
    costs 6-10 s): context parallelism with FSDP, TP and PP (test_cp_parity.py) and GRPO under context parallelism
    with tensor or pipeline parallelism (test_grpo_fsdp.py). tests.objectives.fixed_rollouts runs them: it fixes
    GRPO's responses and leaves the other jobs as they are."""
    from tests.distributed.test_cp_parity import FOUR_PROCESS as CP_JOBS
    from tests.distributed.test_grpo_fsdp import FOUR_PROCESS as GRPO_JOBS

    tmp = tmp_path_factory.mktemp("four_processes")
    done = layout_runs(tmp, 4, {**CP_JOBS, **GRPO_JOBS}, data=(), module="tests.objectives.fixed_rollouts")
    return {name: (run, tmp / name) for name, run in done.items()}
