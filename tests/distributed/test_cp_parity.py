"""Context parallelism (all-gather-KV attention, head-tail load balancing, global RoPE positions), alone
and with FSDP over dp_shard_cp, TP and PP, trains to the same numbers as one process (fp32, gloo).
Tolerances as in test_fsdp_parity.py: losses rel 1e-5, grad norms rel 2e-4 (measured 1.2e-7 and 4-7e-5).
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import assert_matches, layout_run

CP2 = ("--parallelism.context_parallel_degree", "2")


@pytest.mark.parametrize(
    "name, nproc, extra",
    [
        ("cp2", 2, ()),  # FSDP shards over the cp ranks (dp_shard_cp = 2)
        ("cp2_fsdp2", 4, ("--training.local_batch_size", "2")),  # dp_shard_cp = 4
        ("cp2_tp2", 4, ("--parallelism.tensor_parallel_degree", "2")),
        ("cp2_pp2", 4, ("--parallelism.pipeline_parallel_degree", "2")),
    ],
)
def test_context_parallel_matches_single_process(tmp_path, single_process_reference, name, nproc, extra):
    assert_matches(layout_run(tmp_path, name, nproc, *CP2, *extra), single_process_reference)
