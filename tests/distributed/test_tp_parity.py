"""Tensor/sequence parallelism (with loss parallel), alone and with FSDP / HSDP, activation
checkpointing and regional compile, trains to the same numbers as one process (fp32, gloo).

Tolerances as in test_fsdp_parity.py: losses rel 1e-5, grad norms rel 2e-4 (float32 norm rounding
of the single-process reference; the gradients themselves agree to ~1e-6). Measured: losses agree
to 1.2e-7, grad norms to 4-7e-5.
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import Run, assert_matches, layout_run, layout_runs

TP2 = ("--parallelism.tensor_parallel_degree", "2")


LAYOUTS = {  # name: (processes, flags)
    # TP + SP + loss parallel, with per-op selective AC.
    "tp2_sac_op": (2, (*TP2, "--activation_checkpoint.mode", "selective")),
    # TP with gathered logits, gradient accumulation over 2 microbatches, full AC.
    "tp2_no_loss_parallel_accum_full_ac": (
        2,
        (*TP2, "--parallelism.no_enable_loss_parallel", "--training.local_batch_size", "2",
         "--training.global_batch_size", "4", "--activation_checkpoint.mode", "full"),
    ),
    # 2-D: FSDP 2 x TP 2, AC on every second block.
    "fsdp2_tp2_ac_every_2": (
        4,
        (*TP2, "--training.local_batch_size", "2", "--activation_checkpoint.mode", "selective",
         "--activation_checkpoint.selective_ac_option", "2"),
    ),
    # HSDP (2 replicas of shard 1) x TP 2.
    "hsdp2_tp2": (4, (*TP2, "--training.local_batch_size", "2", "--parallelism.data_parallel_replicate_degree", "2")),
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    """Every layout of LAYOUTS, one launch per process count (one torchrun start for the lot)."""
    folder, runs = tmp_path_factory.mktemp("tp"), {}
    for nproc in sorted({nproc for nproc, _ in LAYOUTS.values()}):
        runs |= layout_runs(folder, nproc, {name: extra for name, (n, extra) in LAYOUTS.items() if n == nproc})
    return runs


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tensor_parallel_matches_single_process(runs, single_process_reference, name):
    assert_matches(runs[name], single_process_reference)


def test_compiled_blocks_with_tp_and_sac_match_single_process(tmp_path, single_process_reference, monkeypatch):
    """The one compile test: per-block torch.compile over TP-sharded blocks with per-op SAC.

    About 35 s with a cold inductor cache on 2 cores; the cache lives under /tmp so reruns are faster.
    """
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/titanium_inductor_cache")
    run = layout_run(tmp_path, "tp2_compile", 2, *TP2, "--compile.enable", "--activation_checkpoint.mode", "selective")
    assert_matches(run, single_process_reference)
