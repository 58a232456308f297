"""vLLM in server mode with one engine process for each machine (``--rollout.server_per node``) or for the whole
training job (``job``).

The engine's ranks are the training ranks of one machine (torchrun's ``LOCAL_WORLD_SIZE`` consecutive ranks) or
every rank of the job. The first of them owns the engine process (a ``VLLMServerEngine``); the others start none.
``generate`` is a collective of the engine's ranks: each rank's prompts and seed are gathered to the owner, which
asks the engine for all of them in one request (one batch for vLLM's scheduler; identical requests, as the ranks of
one data-parallel rank make under tensor/pipeline/context parallelism, are generated once) and sends each rank its
own ``Rollouts`` back. Every prompt keeps the seed it would have had in its own rank's engine (the rank's seed plus
its row), so a rank gets what a per-rank engine would have sampled for it (tests/vllm checks this bitwise).

The collectives run on a gloo group of their own, made here: GRPO may generate on a thread while the loop's
forward, backward and gathers use the job's groups, and collectives of one group must not interleave from two
threads. Every rank must call ``generate`` the same number of times in the same order (GRPO's dynamic sampling,
whose rounds differ per rank, is refused with it by config validation).

Weight sync: every rank runs ``sync_from`` (the block-by-block gathers are collectives of the training job); only
the owners copy the blocks into shared memory and have their engines reload them and reset their prefix caches.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from titanium.config.sections import RolloutSection
from titanium.generation.engine import RolloutEngine, Rollouts
from titanium.generation.sampling import SamplingParams
from titanium.generation.vllm_engine import Request, answer_each, as_request, engine_group
from titanium.generation.vllm_server import VLLMServerEngine, check_server
from titanium.models.spec import ModelSpec

logger = logging.getLogger(__name__)

OWNER = 0
"""The rank (in the engine's group: its machine's ranks or every rank of the job, in order) that owns the engine
process."""


def ranks_per_engine(per: str) -> int:
    """How many consecutive training ranks share an engine process with ``--rollout.server_per`` ``per`` (node:
    the processes torchrun started on this machine; job: all)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return int(os.environ.get("LOCAL_WORLD_SIZE", world)) if per == "node" else world


class SharedServerEngine(RolloutEngine):
    background = True  # (its collectives have a group of their own; the engine process does the work)

    def __init__(self, spec: ModelSpec, args: Any, cfg: RolloutSection, *, device_type: str, **options: Any) -> None:
        """``options``: ``VLLMEngine``'s, for the engine process (its seed: the owner's)."""
        check_server(device_type)
        size = ranks_per_engine(cfg.server_per)
        self.group = engine_group(size, f"--rollout.server_per {cfg.server_per}")
        self.owner = self.group is None or dist.get_rank(self.group) == OWNER
        self.server: VLLMServerEngine | None = None
        error = None
        if self.owner:
            try:
                self.server = VLLMServerEngine(spec, args, cfg, device_type=device_type, **options)
            except Exception as e:
                error = e
        if self.group is not None:  # (every rank learns whether the engine started, and raises its error if not)
            shared = [error]
            dist.broadcast_object_list(shared, group=self.group, group_src=OWNER)
            error = shared[0]
        if error is not None:
            raise error

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> Rollouts:
        self.synced_version()
        request = as_request(prompts, seed)
        if self.group is None:
            answer = self._answers([request], params)[0]
        else:
            requests: list[Any] | None = [None] * dist.get_world_size(self.group) if self.owner else None
            dist.gather_object(request, requests, group=self.group, group_dst=OWNER)
            answers = self._answers(requests, params) if requests is not None else None
            mine: list[Any] = [None]
            dist.scatter_object_list(mine, answers, group=self.group, group_src=OWNER)
            answer = mine[0]
        if isinstance(answer, Exception):  # (the engine's error, raised on every rank)
            raise answer
        return answer

    def _answers(self, requests: list[Request], params: SamplingParams) -> list[Rollouts | Exception]:
        """The owner's part of ``generate``: every rank's request in one engine call, its rollouts per rank."""
        assert self.server is not None
        try:
            return answer_each(self.server.generate_many, requests, params)
        except Exception as e:
            return [e] * len(requests)

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        if self.server is not None:  # (the other ranks only took part in the gathers)
            self.server.load_weights(weights)

    def finish_sync(self, version: int) -> None:
        if self.server is not None:
            self.server.finish_sync(version)
        self.version = version

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
