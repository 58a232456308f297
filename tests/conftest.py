"""Test-wide settings and fixtures. Tests never reach for the hub: they use files they make or the repo ships."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture
def make_trainer(monkeypatch):
    """Build Trainers in this process (a one-process gloo group each); closed and torn down after the test."""
    from tests.helpers import REPO
    from titanium.inputs import load_job
    from titanium.parallel.dims import ParallelDims
    from titanium.parallel.distributed import shutdown_distributed
    from titanium.trainer import Trainer

    monkeypatch.chdir(REPO)
    made = []

    def make(*args: str) -> Trainer:
        cfg = load_job(list(args))
        trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallelism, 1))
        made.append(trainer)
        return trainer

    yield make
    for trainer in made:
        trainer.close()
    shutdown_distributed()


def pytest_collection_modifyitems(config, items):
    """Skip the tests marked ``cuda`` where no CUDA GPU is present. The mark is the one way to say a test is
    CUDA-only, so ``pytest -m cuda`` (benchmarks/gpu_suite.sh) selects exactly them."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked cuda)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
