"""titanium's own rollout engine: the sampler of ``generation.generate`` on a separate copy of the policy.

The copy is the family's plain model (no converters: LoRA arrives merged, float8 / QAT as plain weights), built
once on the device in the engine's dtype and refreshed by every sync. Each rank generates its own prompts alone:
unlike sampling from the FSDP-sharded training model, no block is all-gathered per decoded token and data-parallel
ranks never wait for each other. For a model one device cannot hold, ``--rollout.tensor_parallel_size`` (the
training's tensor-parallel degree) splits the copy over each tensor-parallel group, whose ranks generate the same
rows anyway (``generation.tp_plan``). ``compile`` runs the decode step through ``torch.compile`` with a static KV
cache (one graph for every step; meant for GPUs, slow to compile on CPU). With a policy lag allowed it runs on a
generation thread (``generation.background``; on CUDA on a stream of its own) while the loop trains.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from titanium.batch import ImageInputs
from titanium.config.sections import RolloutSection
from titanium.generation.engine import EngineKind, RolloutEngine, Rollouts
from titanium.generation.generate import generate
from titanium.generation.sampling import SamplingParams
from titanium.generation.tp_plan import decoding_group, shard_for_decoding
from titanium.models.spec import ModelSpec


class TitaniumEngine(RolloutEngine):
    background = True  # (plain local forwards on its own copy: a generation thread overlaps them with training)

    def __init__(
        self,
        spec: ModelSpec,
        args: Any,
        *,
        stop_ids: set[int],
        pad_id: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        compile: bool = False,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        """``tp_group``: the engine's own group of ranks to split the copy over (``tp_plan.decoding_group``), or
        None for a whole copy."""
        with torch.device("meta"):
            model = spec.model_cls(args)
        for param in model.parameters():  # (buffers keep their dtype)
            param.data = param.data.to(dtype)
        if tp_group is not None:  # (split while on meta: no rank ever holds the whole copy)
            shard_for_decoding(model, DeviceMesh.from_group(tp_group, device.type))
        model.to_empty(device=device)
        model.init_buffers(device)  # RoPE tables in float32, as training keeps them
        self.model = model.eval().requires_grad_(False)
        self.weights = model.state_dict(keep_vars=True)
        self.stop_ids, self.pad_id, self.device, self.compile = stop_ids, pad_id, device, compile
        self._loaded: set[str] = set()

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, value in weights.items():
                target = self.weights[name]
                if isinstance(target, DTensor):  # (this rank's part of the full value, cut here: no communication)
                    value = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
                    target, value = target.to_local(), value.to_local()
                target.copy_(value)
        self._loaded.update(weights)

    def finish_sync(self, version: int) -> None:
        missing = set(self.weights) - self._loaded
        if missing:  # (a bug of ours: a sync must cover the whole model)
            raise RuntimeError(f"weight sync left out {len(missing)} weights: {sorted(missing)[:6]}")
        self._loaded.clear()
        self.version = version

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int, images: ImageInputs | None = None
    ) -> Rollouts:
        """``images``: an image-text model's prompts' images, read by the prefill (``generate``'s)."""
        version, start = self.synced_version(), time.perf_counter()
        generator = torch.Generator(self.device).manual_seed(seed)
        with torch.no_grad():
            out = generate(
                self.model,
                prompts,
                params,
                self.stop_ids,
                self.pad_id,
                generator=generator,
                compile=self.compile,
                images=images,
            )
        return Rollouts(out, version, time.perf_counter() - start)


def build_titanium_engine(
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
) -> TitaniumEngine:
    """``--rollout.engine titanium`` (``titanium.generation.engine.build_engine``): a whole copy, or one split over the
    training's tensor-parallel group with ``tensor_parallel_size`` > 1."""
    split = decoding_group(tp_group) if cfg.tensor_parallel_size > 1 and tp_group is not None else None
    return TitaniumEngine(
        spec, args, stop_ids=stop_ids, pad_id=pad_id, device=device, dtype=dtype, compile=cfg.compile, tp_group=split
    )


TITANIUM = EngineKind(build_titanium_engine)
"""``--rollout.engine titanium``."""
