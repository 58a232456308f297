"""ParallelDims: degrees resolve and validate before any process group, with errors naming the fix."""

from __future__ import annotations

import pytest

from titanium.config import ConfigError
from titanium.config.sections import ParallelismSection
from titanium.models import build_model_args, get_model_spec
from titanium.parallel.dims import ParallelDims


def dims(world: int, **degrees) -> ParallelDims:
    return ParallelDims.from_config(ParallelismSection(**degrees), world)


def test_shard_degree_takes_the_rest():
    d = dims(16, tensor_parallel_degree=2, data_parallel_replicate_degree=2)
    assert (d.dp_replicate, d.dp_shard, d.tp) == (2, 4, 2)
    assert d.dp_degree == 8 and d.devices_sharing_batch == 2
    assert d.fsdp_enabled and d.tp_enabled and d.loss_parallel_enabled


def test_single_process_has_nothing_enabled():
    d = dims(1)
    assert not d.fsdp_enabled and not d.tp_enabled and not d.params_sharded and d.devices_sharing_batch == 1


def test_loss_parallel_needs_tp():
    assert not dims(2).loss_parallel_enabled
    assert not dims(2, tensor_parallel_degree=2, enable_loss_parallel=False).loss_parallel_enabled


@pytest.mark.parametrize(
    "world, degrees, message",
    [
        (6, {"tensor_parallel_degree": 4}, "must divide the world size 6"),
        (8, {"tensor_parallel_degree": 2, "data_parallel_shard_degree": 2}, "but the world size is 8"),
        (8, {"pipeline_parallel_degree": 3}, r"pipeline_parallel_degree \(3\) x .* = 3 must divide"),
    ],
)
def test_degrees_must_fit_the_world(world, degrees, message):
    with pytest.raises(ConfigError, match=message):
        dims(world, **degrees)


def _debug_args(**overrides):
    return build_model_args(get_model_spec("llama3"), "debugmodel", **overrides).decoder_args()


@pytest.mark.parametrize(
    "tp, args, seq_len, message",
    [
        (8, {}, 64, r"tensor_parallel_degree 8 must divide n_kv_heads=4 of m; valid degrees: 1, 2, 4"),
        (32, {}, 64, r"must divide n_heads=16"),
        (2, {"vocab_size": 2257}, 64, r"must divide vocab_size=2257"),
        (4, {}, 66, r"must divide --training.seq_len 66 .*valid degrees: 1, 2, 3, 6, 11, 22, 33, 66"),
    ],
)
def test_model_aware_checks(tp, args, seq_len, message):
    d = dims(tp, tensor_parallel_degree=tp)
    with pytest.raises(ConfigError, match=message):
        d.check_model(_debug_args(**args), model="m", seq_len=seq_len)


def test_more_pipeline_ranks_than_layers():
    d = dims(8, pipeline_parallel_degree=8)
    with pytest.raises(ConfigError, match="pipeline_parallel_degree 8 is more than the 6 layers of m"):
        d.check_model(_debug_args(), model="m", seq_len=64)


def test_valid_layout_passes_model_checks():
    dims(8, tensor_parallel_degree=4).check_model(_debug_args(), model="m", seq_len=64)


def test_config_range_checks(monkeypatch):
    from tests.helpers import REPO
    from titanium.config import load_config

    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match="tensor_parallel_degree must be >= 1"):
        load_config(["--parallelism.tensor_parallel_degree", "0"])
    with pytest.raises(ConfigError, match="selective_ac_option must be 'op' or a positive integer"):
        load_config(["--activation_checkpoint.selective_ac_option", "sometimes"])
    with pytest.raises(ConfigError, match="enable_async_tensor_parallel needs --compile.enable"):
        load_config(["--compile.enable_async_tensor_parallel", "--parallelism.tensor_parallel_degree", "2"])


def test_compile_checks_depend_on_the_device():
    from titanium.config.sections import ActivationCheckpointSection, CompileSection
    from titanium.parallel.compile import check_compile

    async_tp = CompileSection(enable=True, enable_async_tensor_parallel=True)
    with pytest.raises(ConfigError, match="enable_async_tensor_parallel needs CUDA GPUs"):
        check_compile(async_tp, ActivationCheckpointSection(), True, "cpu")
    check_compile(async_tp, ActivationCheckpointSection(), True, "cuda")
    full_ac = ActivationCheckpointSection(mode="full")
    with pytest.raises(ConfigError, match="whole-block activation checkpointing fails on CPU"):
        check_compile(CompileSection(enable=True), full_ac, True, "cpu")
    check_compile(CompileSection(enable=True), full_ac, True, "cuda")
    check_compile(CompileSection(enable=True), ActivationCheckpointSection(mode="selective"), True, "cpu")


def test_context_parallel_needs_two_chunks_per_rank():
    with pytest.raises(ConfigError, match=r"seq_len 60 must be divisible by 2 x .*context_parallel_degree 4"):
        dims(4, context_parallel_degree=4).check_model(_debug_args(), model="m", seq_len=60)
    with pytest.raises(ConfigError, match="must divide the per-rank sequence seq_len / context_parallel_degree = 6"):
        dims(8, context_parallel_degree=2, tensor_parallel_degree=4).check_model(_debug_args(), model="m", seq_len=12)
