"""The rollout-engine seam: what an RL objective asks for rollouts, and what the loop hands new weights to.

An engine holds its own copy of the policy (titanium's model, unsharded, in this process; or vLLM's) and never
touches the training model. The two calls:

- ``generate(prompts, params, seed)`` -> ``Rollouts``: the sampled tokens, the engine's own log-probs of them (the
  convention of ``titanium.generation.sampling``: ``log_softmax(logits / T)`` over the whole vocabulary) and the
  policy version of the weights that produced them;
- ``sync_from(model, version, pp_group)`` after each optimizer step: the training model's weights gathered one
  block at a time from whatever layout it trains in (``titanium.checkpoint.full_blocks``), pushed into the engine
  without touching disk, then the engine's caches of the old weights are dropped (``finish_sync``). Every rank of the
  training job calls it (the gathers are collectives); it returns its seconds, blocks and bytes.

``load_weights`` takes any subset of the policy's weights under their one-process titanium names (a block), so a
sync is a sequence of them; an engine that speaks Hugging Face names translates with the family's adapter.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titanium.checkpoint.full_blocks import full_blocks
from titanium.config.components import ENGINES
from titanium.config.sections import RolloutSection
from titanium.generation.generate import Generation
from titanium.generation.sampling import SamplingParams
from titanium.model_builder import DTYPES
from titanium.models.spec import ModelSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rollouts:
    """What an engine made for a batch of prompts (rows in the order of the prompts)."""

    generation: Generation
    """Tokens, the engine's log-probs of them, lengths, finished flags (see ``Generation``)."""
    version: int
    """Policy version (optimizer steps) of the weights that generated every row."""
    seconds: float
    """Wall time of the call."""


@dataclass(frozen=True)
class SyncStats:
    """What one ``sync_from`` moved, and how long it took (to log per sync)."""

    seconds: float
    blocks: int
    bytes: int


class RolloutEngine(ABC):
    """A generator with its own copy of the policy, refreshed by ``sync_from``."""

    version: int | None = None
    """Policy version (optimizer steps) of the weights synced last; None before the first sync."""
    background = False
    """Whether ``generate`` may run on a thread of its own while the process trains (``generation.background``):
    work on the engine's own weights, no collective on the training's process groups (an engine split over ranks
    uses a group of its own), nothing tied to the loop's thread; on CUDA its kernels go to the thread's current
    stream (its own: ``generation.side_stream``)."""

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> Rollouts:
        """Sample a response to each prompt (token ids) with ``params``; ``seed`` makes the call reproducible
        (the same seed, prompts and weights give the same tokens)."""

    @abstractmethod
    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy full tensors under one-process titanium names (any subset of the policy: a block) into the
        engine's copy. Their values must not change until the call returns; the engine keeps no reference."""

    @abstractmethod
    def finish_sync(self, version: int) -> None:
        """Every weight of a sync is loaded: drop what was computed from the old ones (KV / prefix caches) and
        tag what follows with ``version``."""

    def synced_version(self) -> int:
        """The version rollouts are tagged with; an engine never synced holds no policy and refuses to generate."""
        if self.version is None:
            raise RuntimeError(f"{type(self).__name__} generates only after a first sync_from (it holds no policy yet)")
        return self.version

    def sync_from(self, model: nn.Module, version: int, pp_group: dist.ProcessGroup | None = None) -> SyncStats:
        """Load the training ``model``'s current weights (any layout; collective over the training job)."""
        start = time.perf_counter()
        blocks = size = 0
        for block in full_blocks(model, pp_group):
            self.load_weights(block)
            blocks += 1
            size += sum(t.numel() * t.element_size() for t in block.values())
            del block  # before the next one is gathered
        self.finish_sync(version)
        stats = SyncStats(time.perf_counter() - start, blocks, size)
        logger.info(
            "weight sync to version %d: %d blocks, %.1f MB in %.3f s", version, blocks, size / 1e6, stats.seconds
        )
        return stats

    def close(self) -> None:  # noqa: B027 (most engines hold nothing to free)
        """Free the engine, at the end of the job (vLLM's teardown destroys the default process group)."""


@dataclass(frozen=True)
class EngineKind:
    """A rollout engine as ``--rollout.engine`` names it (``ENGINES`` in titanium/config/components.py, or your own by
    import path): how to build it in a process, and what it cannot do with a job, said before any process starts."""

    build: Callable[..., RolloutEngine]
    """``(cfg: RolloutSection, spec, args, *, stop_ids, pad_id, max_model_len, device, dtype, seed, tp_group)``."""
    check: Callable[..., None] = lambda *args, **kwargs: None
    """``(cfg, spec, args, *, max_model_len, world_size, device_type)``: raise ``ConfigError`` for what it cannot do."""


def check_engine(
    cfg: RolloutSection, spec: ModelSpec, args: Any, *, max_model_len: int, world_size: int, device_type: str
) -> None:
    """What the ``[rollout]`` engine cannot do with a policy of family ``spec`` and ``args`` in a job of ``world_size``
    processes on ``device_type``, decided before any process starts (titanium.preflight; ``max_model_len``: the
    longest prompt plus its answer)."""
    kind = ENGINES.load(cfg.engine)
    kind.check(cfg, spec, args, max_model_len=max_model_len, world_size=world_size, device_type=device_type)


def build_engine(
    cfg: RolloutSection,
    spec: ModelSpec,
    args: Any,
    *,
    stop_ids: set[int],
    pad_id: int,
    max_model_len: int,
    device: torch.device,
    training_dtype: torch.dtype,
    seed: int,
    tp_group: dist.ProcessGroup | None = None,
) -> RolloutEngine:
    """The ``[rollout]`` engine for a policy of family ``spec`` with ``args``, in this process, built by the
    ``EngineKind`` registered as ``cfg.engine``. It holds no weights until the first ``sync_from``.
    ``max_model_len``: the longest prompt plus its answer; ``seed`` varies per rank; the engine's dtype is
    ``cfg.dtype`` (``auto``: the training forward's, ``training_dtype``); ``tp_group``: the policy's tensor-parallel
    group, which the titanium engine splits its copy over when ``tensor_parallel_size`` > 1 (collective: every rank
    of the job builds its engine together)."""
    dtype = training_dtype if cfg.dtype == "auto" else DTYPES[cfg.dtype]
    return ENGINES.load(cfg.engine).build(
        cfg,
        spec,
        args,
        stop_ids=stop_ids,
        pad_id=pad_id,
        max_model_len=max_model_len,
        device=device,
        dtype=dtype,
        seed=seed,
        tp_group=tp_group,
    )
