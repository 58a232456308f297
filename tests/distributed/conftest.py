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
def scalar_model_folder(tmp_path_factory) -> str:
    """A debug-sized Hugging Face sequence-classification folder: PPO's reward model, which also starts its value
    model, in the layout tests."""
    from tests.objectives.tiny_hf import debug_model_hf

    return debug_model_hf(tmp_path_factory.mktemp("reward") / "hf", scalar=True)


@pytest.fixture(scope="session")
def four_process_runs(tmp_path_factory, scalar_model_folder) -> dict[str, tuple[Run, Path]]:
    """name -> (run, its folder) of every 4-process job of the layout tests, all in one launch (a torchrun start
    costs 6-10 s): context parallelism with FSDP, TP and PP (test_cp_parity.py), GRPO under context parallelism
    with tensor or pipeline parallelism and PPO under context and pipeline parallelism (test_grpo_fsdp.py), an
    image-text model's SFT and DPO under FSDP 2 x TP 2 (test_vision_fsdp.py). tests.objectives.fixed_rollouts runs
    them: it fixes GRPO's and PPO's responses and leaves the other jobs as they are."""
    from tests.distributed.test_cp_parity import FOUR_PROCESS as CP_JOBS
    from tests.distributed.test_grpo_fsdp import four_process_jobs
    from tests.distributed.test_vision_fsdp import vision_jobs

    tmp = tmp_path_factory.mktemp("four_processes")
    jobs = {**CP_JOBS, **four_process_jobs(scalar_model_folder), **vision_jobs(tmp / "vision_inputs", 4)}
    done = layout_runs(tmp, 4, jobs, data=(), module="tests.objectives.fixed_rollouts")
    return {name: (run, tmp / name) for name, run in done.items()}
