"""The compute dtype of a job: ``training.mixed_precision_param`` resolved for the device the job runs on.

bf16 halves the bytes of every matmul operand and runs faster than float32 on GPUs and on CPUs with bf16
instructions. A CPU without them only emulates bf16 (float32 arithmetic plus conversions): there the debug model
trained 33x slower in bf16 than in float32 (a 2-core AVX2 AMD EPYC, issue 27). So ``auto`` takes bf16 only where
it is native. The trainer (every layout) and the dry run both resolve the setting here, so they agree.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("titanium")

NATIVE_BF16_CPU_FEATURES = ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16")
"""Keys of ``torch.cpu.get_capabilities()`` that mean bf16 arithmetic in hardware: AVX512-BF16 and AMX on x86,
BF16 (FEAT_BF16) and SVE BF16 on Arm."""

NO_NATIVE_BF16 = "this CPU has no native bf16 (AVX512-BF16, AMX or Arm BF16)"


def cpu_bf16_features() -> list[str]:
    """This CPU's native bf16 features that torch's bf16 matmuls (oneDNN) use; empty: bf16 is emulated. oneDNN
    also counts AVX512 without BF16 (emulated, 2.5x slower than float32 in a Linear here) and honours
    ``ONEDNN_MAX_CPU_ISA``, hence both questions."""
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return []
    capabilities = torch.cpu.get_capabilities()
    return [name for name in NATIVE_BF16_CPU_FEATURES if capabilities.get(name)]


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16``: the name the config uses."""
    return str(dtype).removeprefix("torch.")


def compute_dtype(setting: str, device_type: str, *, announce: bool = True) -> torch.dtype:
    """The dtype forward and backward compute in for ``setting`` (auto, bfloat16 or float32) on ``device_type``:
    auto is bfloat16 on an accelerator (CUDA) and on a CPU with native bf16, else float32. With ``announce``
    (one rank of a job) logs the choice and why, and warns once when an explicit bfloat16 will be emulated."""
    features = cpu_bf16_features() if device_type == "cpu" else []
    emulated = device_type == "cpu" and not features
    if setting == "auto":
        dtype = torch.float32 if emulated else torch.bfloat16
        if device_type != "cpu":
            why = f"auto: {device_type.upper()}"
        else:
            why = f"auto: {NO_NATIVE_BF16}" if emulated else f"auto: this CPU has native bf16 ({', '.join(features)})"
    else:
        dtype = getattr(torch, setting)  # (the config allows bfloat16 and float32)
        why = f"--training.mixed_precision_param {setting}"
    if announce:
        logger.info("compute dtype %s (%s)", dtype_name(dtype), why)
        if emulated and dtype == torch.bfloat16:
            logger.warning(
                "--training.mixed_precision_param bfloat16: %s, so bf16 is emulated and trains many times slower "
                "than float32 (33x for the debug model on an AVX2 CPU); auto or float32 avoid it",
                NO_NATIVE_BF16,
            )
    return dtype
