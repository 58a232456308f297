"""The compute dtype follows the device: the default debug job computes in float32 on a CPU without native bf16
(where bf16 is emulated and many times slower) and in bf16 where the CPU has it; the trainer and the dry run agree."""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.helpers import REPO
from titanium.precision import compute_dtype
from titanium.tools.dry_run import dry_run

NO_BF16: list[str] = []
AVX512_BF16 = ["avx512_bf16"]
# The debug job as shipped (it sets no dtype: the default), smaller steps.
DEBUG_JOB = [
    "--job.config_file", str(REPO / "train_configs/debug_model.toml"),
    "--job.no_print_config", "--checkpoint.no_enable", "--metrics.no_enable_tensorboard",
    "--training.seq_len", "64", "--training.local_batch_size", "2",
]  # fmt: skip


@pytest.fixture
def cpu_bf16(monkeypatch):
    """Pretend this CPU has the given native bf16 features (none: an AVX2-only CPU)."""

    def pretend(features: list[str]) -> None:
        monkeypatch.setattr("titanium.precision.cpu_bf16_features", lambda: list(features))

    return pretend


def _compute_dtypes(trainer) -> set[torch.dtype]:
    """The dtypes the model's linear layers output in one forward/backward of the trainer's step."""
    seen: set[torch.dtype] = set()
    hooks = [
        m.register_forward_hook(lambda _m, _args, out: seen.add(out.dtype))
        for m in trainer.model.modules()
        if isinstance(m, nn.Linear)
    ]
    trainer.forward_backward([trainer.objective.next_microbatch()])
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize(
    ("features", "dtype"), [(NO_BF16, torch.float32), (AVX512_BF16, torch.bfloat16)], ids=["no-bf16", "bf16-cpu"]
)
def test_default_debug_job_computes_in_bf16_only_on_a_cpu_with_native_bf16(
    make_trainer, tmp_path, cpu_bf16, caplog, features, dtype
):
    cpu_bf16(features)
    with caplog.at_level(logging.INFO, logger="titanium"):
        trainer = make_trainer(*DEBUG_JOB, "--job.dump_folder", str(tmp_path))
    assert trainer.cfg.training.mixed_precision_param == "auto"
    assert _compute_dtypes(trainer) == {dtype}
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}  # weights stay float32
    assert {p.grad.dtype for p in trainer.model.parameters()} == {torch.float32}
    reason = "this CPU has no native bf16" if not features else "this CPU has native bf16 (avx512_bf16)"
    assert f"compute dtype {str(dtype).removeprefix('torch.')} (auto: {reason}" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "bf16" in r.getMessage()]


def test_explicit_bf16_on_a_cpu_without_it_runs_emulated_with_one_warning(make_trainer, tmp_path, cpu_bf16, caplog):
    cpu_bf16(NO_BF16)
    with caplog.at_level(logging.INFO, logger="titanium"):
        trainer = make_trainer(
            *DEBUG_JOB, "--job.dump_folder", str(tmp_path), "--training.mixed_precision_param", "bfloat16"
        )
        assert _compute_dtypes(trainer) == {torch.bfloat16}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "emulated" in warnings[0] and "--training.mixed_precision_param" in warnings[0]
    assert "compute dtype bfloat16 (--training.mixed_precision_param bfloat16)" in caplog.text


def test_the_rule(cpu_bf16, caplog):
    cpu_bf16(NO_BF16)
    assert compute_dtype("auto", "cuda") == torch.bfloat16  # (the CPU does not matter for a GPU job)
    assert compute_dtype("auto", "cpu") == torch.float32
    assert compute_dtype("float32", "cuda") == torch.float32
    cpu_bf16(["amx_bf16"])
    assert compute_dtype("auto", "cpu") == torch.bfloat16
    with caplog.at_level(logging.INFO, logger="titanium"):
        compute_dtype("bfloat16", "cpu", announce=False)  # (the ranks other than 0)
    assert not caplog.records


@pytest.mark.parametrize(
    ("features", "device_type", "dtype"),
    [(NO_BF16, "cpu", torch.float32), (AVX512_BF16, "cpu", torch.bfloat16), (NO_BF16, "cuda", torch.bfloat16)],
)
def test_dry_run_estimates_the_dtype_training_would_use(monkeypatch, cpu_bf16, features, device_type, dtype):
    """Under FSDP (2 ranks) too: the plan's dtype is what FSDP gathers the weights in."""
    monkeypatch.chdir(REPO)
    cpu_bf16(features)
    try:
        run = dry_run(["--job.config_file", "train_configs/debug_model.toml"], world_size=2, device_type=device_type)
    finally:
        dist.destroy_process_group()
    assert run.dims.fsdp_enabled and run.job.plan.param_dtype == dtype
    assert next(run.report()).endswith(f"compute dtype {str(dtype).removeprefix('torch.')}")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="ONEDNN_MAX_CPU_ISA=AVX2 is an x86 setting")
def test_a_cpu_limited_to_avx2_has_no_native_bf16():
    """The real query, no monkeypatching: oneDNN held to AVX2 (as on an AVX2-only CPU) makes auto pick float32."""
    code = "from titanium.precision import compute_dtype as c, cpu_bf16_features as f; print(f(), c('auto', 'cpu'))"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "torch.float32"]
