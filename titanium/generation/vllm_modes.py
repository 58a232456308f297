"""``--rollout.engine vllm``: the vLLM engine for ``--rollout.mode`` and ``--rollout.server_per`` (colocated in each
training process, or in engine processes of its own: one per rank, or shared by a machine's or the job's ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from titanium.config.sections import RolloutSection
from titanium.generation.engine import EngineKind, RolloutEngine
from titanium.generation.vllm_engine import VLLMEngine, check_vllm
from titanium.generation.vllm_server import VLLMServerEngine
from titanium.generation.vllm_shared import SharedServerEngine
from titanium.models.spec import ModelSpec


def build_vllm_engine(
    cfg: RolloutSection,
    spec: ModelSpec,
    args: Any,
    *,
    stop_ids: set[int],
    pad_id: int,
    max_model_len: int,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    tp_group: dist.ProcessGroup | None = None,
) -> RolloutEngine:
    """The vLLM engine of ``cfg``'s mode (``titanium.generation.engine.build_engine``); vLLM splits itself over
    ``--rollout.tensor_parallel_size`` training ranks, so the policy's tensor-parallel group is not used."""
    if cfg.mode == "server":
        kind = VLLMServerEngine if cfg.server_per == "rank" else SharedServerEngine
    else:
        kind = VLLMEngine
    return kind(
        spec,
        args,
        cfg,
        stop_ids=stop_ids,
        pad_id=pad_id,
        max_model_len=max_model_len,
        dtype=dtype,
        seed=seed,
        device_type=device.type,
    )


VLLM = EngineKind(build_vllm_engine, check_vllm)
"""``--rollout.engine vllm``."""
