"""Pipeline splitting and stage placement, checked without processes."""

from __future__ import annotations

import pytest

from titanium.config import ConfigError
from titanium.config.sections import ParallelismSection
from titanium.parallel.pipeline import split_layers, stage_ids_of_rank

LAYERS = [str(i) for i in range(6)]


def split(pp: int, **cfg) -> list[list[str]]:
    return split_layers(LAYERS, pp, ParallelismSection(pipeline_parallel_degree=pp, **cfg))


def test_default_split_is_one_stage_per_rank_or_two_for_multi_stage_schedules():
    assert split(2) == [["0", "1", "2"], ["3", "4", "5"]]
    assert split(2, pipeline_parallel_schedule="Interleaved1F1B") == [["0", "1"], ["2", "3"], ["4"], ["5"]]


def test_layers_per_stage_and_split_points():
    assert len(split(2, pipeline_parallel_schedule="LoopedBFS", pipeline_parallel_layers_per_stage=1)) == 6
    assert split(2, pipeline_parallel_split_points=["layers.2"]) == [["0", "1"], ["2", "3", "4", "5"]]


@pytest.mark.parametrize(
    "pp, cfg, message",
    [
        (2, {"pipeline_parallel_layers_per_stage": 2}, "1F1B runs one stage per rank, but the split gives 3"),
        (2, {"pipeline_parallel_schedule": "ZBVZeroBubble", "pipeline_parallel_layers_per_stage": 1}, "exactly 2"),
        (4, {"pipeline_parallel_schedule": "Interleaved1F1B"}, "8 pipeline stages for 6 blocks"),
        (2, {"pipeline_parallel_split_points": ["layers.9"]}, "'layers.9' is not a block"),
        (3, {"pipeline_parallel_schedule": "LoopedBFS", "pipeline_parallel_layers_per_stage": 3}, "not a multiple"),
    ],
)
def test_bad_splits_name_the_flag(pp, cfg, message):
    with pytest.raises(ConfigError, match=message):
        split(pp, **cfg)


def test_stage_placement():
    assert stage_ids_of_rank("1F1B", 1, 4, 4) == [1]
    assert stage_ids_of_rank("Interleaved1F1B", 1, 2, 6) == [1, 3, 5]  # looped
    assert stage_ids_of_rank("ZBVZeroBubble", 0, 2, 4) == [0, 3]  # V: first and last stage on rank 0
    assert stage_ids_of_rank("DualPipeV", 1, 2, 4) == [1, 2]


def test_unknown_schedule_is_a_config_error(monkeypatch):
    from tests.helpers import REPO
    from titanium.config import load_config

    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match="pipeline_parallel_schedule 'Zigzag' is not a schedule; valid: GPipe"):
        load_config(["--parallelism.pipeline_parallel_schedule", "Zigzag"])


def test_zero_bubble_schedules_refuse_tensor_parallelism(monkeypatch):
    from tests.helpers import REPO
    from titanium.config import load_config

    monkeypatch.chdir(REPO)
    args = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"]
    with pytest.raises(ConfigError, match="ZBVZeroBubble .* does not work with --parallelism.tensor_parallel_degree"):
        load_config([*args, "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"])
