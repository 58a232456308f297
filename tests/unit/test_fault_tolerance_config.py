"""[fault_tolerance]: the config checks, the data shard of each group, and which group checkpoints.

The training behaviour (kill, heal, losses) is tested in tests/distributed/test_fault_tolerance.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from titanium.config import ConfigError, load_config
from titanium.config.sections import CheckpointSection, FaultToleranceSection
from titanium.errors import UserError
from titanium.fault_tolerance import FaultTolerance

FT = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--fault_tolerance.lighthouse", "http://h:1"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--fault_tolerance.group_size", "0"], "--fault_tolerance.group_size must be >= 1"),
        (["--fault_tolerance.replica_id", "2"], r"--fault_tolerance.replica_id must be in 0..1"),
        (["--fault_tolerance.min_replica_size", "3"], r"--fault_tolerance.min_replica_size must be in 1..group_size"),
        (["--fault_tolerance.timeout_seconds", "0"], "--fault_tolerance.timeout_seconds must be > 0"),
        (["--parallelism.pipeline_parallel_degree", "2"], "does not support pipeline parallelism"),
        (["--optimizer.early_step_in_backward"], "cannot use --optimizer.early_step_in_backward"),
    ],
)
def test_bad_combinations_are_config_errors(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config([*FT, *args])


def test_the_lighthouse_address_comes_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match="TORCHFT_LIGHTHOUSE"):
        load_config(["--fault_tolerance.enable"])
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510")
    assert load_config(["--fault_tolerance.enable"]).fault_tolerance.enable
    assert load_config(FT).fault_tolerance.group_size == 2


def test_off_by_default_and_its_checks_only_apply_when_on():
    cfg = load_config(["--parallelism.pipeline_parallel_degree", "2", "--fault_tolerance.group_size", "0"])
    assert not cfg.fault_tolerance.enable


def _group(replica_id: int, group_size: int) -> SimpleNamespace:
    """What data_shard and checkpoint_section read of a FaultTolerance (no lighthouse needed)."""
    return SimpleNamespace(cfg=FaultToleranceSection(enable=True, replica_id=replica_id, group_size=group_size))


def test_each_rank_of_each_group_reads_its_own_shard():
    shards = [FaultTolerance.data_shard(_group(g, 3), rank, 2) for g in range(3) for rank in range(2)]
    assert shards == [(i, 6) for i in range(6)]


def test_only_group_0_writes_checkpoints():
    ck = CheckpointSection(enable=True, last_save_in_hf=True)
    assert FaultTolerance.checkpoint_section(_group(0, 2), ck) is ck
    other = FaultTolerance.checkpoint_section(_group(1, 2), ck)
    assert not other.enable and not other.last_save_in_hf


def test_a_group_must_be_started_by_torchrun(monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(UserError, match="launch each replica group with torchrun"):
        FaultTolerance(FaultToleranceSection(enable=True), torch.device("cpu"))


def test_a_healing_group_moves_its_own_data_forward_once_the_peers_state_is_in():
    """After every shared state has taken the peer's values, ``healed`` gets the steps this group skipped (none when
    the peer is behind) and the step it is at now, so the trainer skips its own shard and resyncs followers."""
    from titanium.checkpoint.states import TrainState

    calls: list[tuple[int, int, int]] = []
    own = TrainState()
    own.step = 3  # (e.g. group 0 resumed from its checkpoint of step 3 while its peer went on to step 10)
    ft = object.__new__(FaultTolerance)  # (no manager: only what a heal runs)
    model = torch.nn.Linear(2, 2)
    ft._states, ft._train_state = {"model": model, "train_state": own}, own
    ft._healed = lambda skipped, step: calls.append((skipped, step, int(model.weight.sum() == 0)))
    zeros = {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}
    peer = {"model": zeros, "train_state": {"step": 10, "tokens_seen": 0}}
    ft._load_peer_state(peer)
    own.step = 12
    ft._load_peer_state(peer)  # a peer behind this group: nothing to skip (it would heal from us)
    assert calls == [(7, 10, 1), (0, 10, 1)]
