"""Context parallelism (all-gather-KV attention, head-tail load balancing, global RoPE positions), alone
and with FSDP over dp_shard_cp, TP and PP, trains to the same numbers as one process (fp32, gloo).
Tolerances as in test_fsdp_parity.py: losses rel 1e-5, grad norms rel 2e-4 (measured 1.2e-7 and 4-7e-5).
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import assert_matches, layout_runs

CP2 = ("--parallelism.context_parallel_degree", "2")


# Grouped by process count: one torchrun start per group.
LAYOUTS = {
    2: {"cp2": ()},  # FSDP shards over the cp ranks (dp_shard_cp = 2)
    4: {
        "cp2_fsdp2": ("--training.local_batch_size", "2"),  # dp_shard_cp = 4
        "cp2_tp2": ("--parallelism.tensor_parallel_degree", "2"),
        "cp2_pp2": ("--parallelism.pipeline_parallel_degree", "2"),
    },
}


@pytest.mark.parametrize("nproc", sorted(LAYOUTS))
def test_context_parallel_matches_single_process(tmp_path, single_process_reference, nproc):
    for name, run in layout_runs(tmp_path, nproc, LAYOUTS[nproc], *CP2).items():
        print(name)
        assert_matches(run, single_process_reference)
