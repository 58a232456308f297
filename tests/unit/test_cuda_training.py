"""Training on a CUDA GPU against references that need no GPU to trust: bf16 against float32 (dense and MoE),
compiled against eager, optimizer-in-backward against the ordinary step, and the measured peak memory against the
dry run's estimate.
All marked ``cuda``: skipped without a GPU, run by ``pytest -m cuda`` (benchmarks/gpu_suite.sh). Float8 on tensor
cores is in test_float8.py (``test_real_float8_training_is_close_to_bf16``), with the same mark."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import scalars, tiny_args
from titanium.parallel.distributed import shutdown_distributed

pytestmark = pytest.mark.cuda
GRAD_NORM = "optim/grad_norm"


def _train(make_trainer, folder: Path, *flags: str, steps: int = 5) -> tuple[dict[int, float], dict[int, float]]:
    """Losses and grad norms per step of the debug model on synthetic data, on the GPU."""
    args = tiny_args(folder, "--data.kind", "synthetic", "--training.steps", str(steps), "--training.seq_len", "256")
    trainer = make_trainer(*args, *flags)
    assert trainer.device.type == "cuda"
    trainer.train()
    trainer.close()
    shutdown_distributed()
    return scalars(folder / "tb"), scalars(folder / "tb", GRAD_NORM)


def test_bf16_training_is_close_to_float32(make_trainer, tmp_path):
    """Autocast bf16 (one GPU, no FSDP) against float32 from the same weights and data: five steps' losses
    within 2% (bf16 keeps 8 bits of mantissa; the loss moves by a few percent over these steps), not equal."""
    fp32, _ = _train(make_trainer, tmp_path / "fp32")
    bf16, _ = _train(make_trainer, tmp_path / "bf16", "--training.mixed_precision_param", "bfloat16")
    assert bf16 != fp32
    for step, loss in fp32.items():
        assert bf16[step] == pytest.approx(loss, rel=2e-2), (step, bf16, fp32)


def test_moe_bf16_training_is_close_to_float32(make_trainer, tmp_path):
    """The Qwen3-MoE debug model on the GPU: bf16 (experts through ``torch._grouped_mm``, forward and backward)
    against float32 (padded ``bmm``) from the same weights and data: five steps' losses within 3%, not equal (bf16
    also flips the top-k choice of a few tokens; on CPU, without bf16 kernels, the two agree to 1e-5)."""
    moe = ("--model.name", "qwen3_moe", "--model.flavor", "debugmodel_moe")
    fp32, _ = _train(make_trainer, tmp_path / "fp32", *moe)
    bf16, _ = _train(make_trainer, tmp_path / "bf16", *moe, "--training.mixed_precision_param", "bfloat16")
    for step, loss in fp32.items():
        assert bf16[step] == pytest.approx(loss, rel=3e-2), (step, bf16, fp32)
    assert bf16 != fp32


def test_compiled_training_equals_eager(make_trainer, tmp_path):
    """Per-block torch.compile (inductor's Triton kernels) against eager, float32: losses and grad norms to 1e-3
    relative over 5 steps (fused kernels reorder reductions, ~1e-6 per step, which AdamW's normalized updates can
    grow; a wrong kernel would be off by far more)."""
    eager, eager_norms = _train(make_trainer, tmp_path / "eager")
    compiled, norms = _train(make_trainer, tmp_path / "compiled", "--compile.enable")
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], rel=1e-3), step
        assert norms[step] == pytest.approx(eager_norms[step], rel=1e-3), step


def test_optimizer_in_backward_trains_like_the_step(make_trainer, tmp_path):
    """Fused AdamW stepped inside the backward, per parameter, against the ordinary step after it (no clipping,
    one microbatch, which in-backward needs; deterministic kernels, so the gradients are the same bits): the same
    losses to 1e-6 (the step is elementwise, so it should be bitwise; the CPU test asserts that)."""
    flags = ("--training.max_norm", "0", "--debug.deterministic")
    plain, _ = _train(make_trainer, tmp_path / "plain", *flags)
    early, _ = _train(make_trainer, tmp_path / "early", *flags, "--optimizer.early_step_in_backward")
    for step in plain:
        assert early[step] == pytest.approx(plain[step], rel=1e-6), step


def test_peak_memory_is_near_the_dry_run_estimate(make_trainer, tmp_path):
    """The dry run's estimate for one GPU (traced on fake tensors, nothing allocated) against the caching
    allocator's peak of the real run, 8 x 1024 tokens in float32: within 25%. The estimate does not count what
    CUDA libraries allocate through the allocator (cuBLAS workspaces) and traces the attention of the CPU.
    The run's peak is the highest of the peaks the trainer logs (each of a window between log steps: the trainer
    resets the allocator's peak at each, so the allocator's own peak after training is that of the last window,
    after the last step, which is only the weights and optimizer states)."""
    import torch.distributed as dist

    from titanium.tools.dry_run import dry_run

    args = tiny_args(
        tmp_path, "--data.kind", "synthetic", "--training.steps", "3", "--training.seq_len", "1024",
        "--training.local_batch_size", "8",
    )  # fmt: skip
    try:
        estimate = dry_run(args, 1, 0, device_type="cuda").estimate_memory().peak
    finally:
        dist.destroy_process_group()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()  # (what earlier tests of the process left)
    trainer = make_trainer(*args)
    trainer.train()
    trainer.close()
    measured = max(scalars(tmp_path / "tb", "memory/peak_gib").values()) * 2**30 - baseline
    assert measured == pytest.approx(estimate, rel=0.25), (measured / 2**20, estimate / 2**20)
