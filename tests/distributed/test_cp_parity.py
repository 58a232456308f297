"""Context parallelism (all-gather-KV attention, head-tail load balancing, global RoPE positions), alone
and with FSDP over dp_shard_cp, TP and PP, trains to the same numbers as one process (fp32, gloo).
Tolerances as in test_fsdp_parity.py: losses rel 1e-5, grad norms rel 2e-4 (measured 1.2e-7 and 4-7e-5).
The 4-process layouts run in the launch the layout tests share (conftest.py's four_process_runs).
"""

from __future__ import annotations

from tests.distributed.parity import SYNTHETIC, assert_matches, layout_runs

CP2 = ("--parallelism.context_parallel_degree", "2")

FOUR_PROCESS = {
    name: (*SYNTHETIC, *CP2, *extra)
    for name, extra in {
        "cp2_fsdp2": ("--training.local_batch_size", "2"),  # dp_shard_cp = 4
        "cp2_tp2": ("--parallelism.tensor_parallel_degree", "2"),
        "cp2_pp2": ("--parallelism.pipeline_parallel_degree", "2"),
    }.items()
}


def test_context_parallel_matches_single_process(tmp_path, single_process_reference):
    """2 processes: FSDP shards over the cp ranks (dp_shard_cp = 2)."""
    assert_matches(layout_runs(tmp_path, 2, {"cp2": ()}, *CP2)["cp2"], single_process_reference)


def test_context_parallel_with_fsdp_tp_pp_matches_single_process(four_process_runs, single_process_reference):
    for name in FOUR_PROCESS:
        assert_matches(four_process_runs[name][0], single_process_reference)
