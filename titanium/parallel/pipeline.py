"""Pipeline parallelism: cut the meta model into stages, place them on the pp ranks, run a schedule.

The model is cut by deep-copying it on the meta device and deleting, in each copy, the blocks of other
stages (and the embedding / final norm / output where they do not belong); the Llama Transformer runs
with any of those missing. Each stage is then parallelized like a whole model (TP -> AC -> compile ->
FSDP). The stages this rank holds are also gathered into one container with the original parameter
names, which the optimizer, the checkpoints and gradient clipping see as "the model".
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from titanium.config.loader import ConfigError
from titanium.config.sections import ParallelismSection
from titanium.models.common.moe import uncounted

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
"""Two stages per rank placed as a V: rank r holds stages r and 2*pp-1-r."""


class _Stage(PipelineStage):
    """torch's PipelineStage, with two adjustments.

    No links to its own rank: torch 2.11's schedules open the links between neighbouring stages with a dummy send
    and receive to each neighbour's rank, also where that is this rank (the V placements keep two neighbouring
    stages on one rank), which gloo cannot do ("Pair is not connected"); the tensors between two stages of one rank
    never travel anyway. (torch 2.13 opens the links another way.)

    Metadata inference (torch 2.13: a training forward of the first microbatch, with empty tensors on later
    stages) does not count as routed tokens of an MoE model. torch 2.11 infers shapes under no_grad, which MoE
    layers never count, and has no such method to wrap.
    """

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        with uncounted(self.submod):
            return super()._forward_metadata_inference(*args, **kwargs)


def is_multi_stage(schedule: str) -> bool:
    return not issubclass(get_schedule_class(schedule), PipelineScheduleSingle)


def stage_ids_of_rank(schedule: str, pp_rank: int, pp_size: int, n_stages: int) -> list[int]:
    """Stages held by ``pp_rank``: one for single-stage schedules, looped (r, r+pp, ...) or V-shaped."""
    if schedule in V_SCHEDULES:
        return [pp_rank, n_stages - 1 - pp_rank]
    return list(range(pp_rank, n_stages, pp_size))


def split_layers(layer_names: list[str], pp_size: int, cfg: ParallelismSection) -> list[list[str]]:
    """Group the blocks (in order) into stages, and check the count fits the schedule."""
    schedule, flag = cfg.pipeline_parallel_schedule, "--parallelism.pipeline_parallel"
    n_layers = len(layer_names)
    if cfg.pipeline_parallel_split_points:
        names = [f"layers.{n}" for n in layer_names]
        starts = []
        for point in cfg.pipeline_parallel_split_points:
            if point not in names:
                valid = f"layers.1 .. layers.{n_layers - 1}"
                raise ConfigError(f"{flag}_split_points: {point!r} is not a block; valid: {valid}")
            starts.append(names.index(point))
        if starts != sorted(set(starts)) or starts[0] == 0:
            raise ConfigError(f"{flag}_split_points must be increasing blocks after layers.0, got {starts}")
        bounds = [0, *starts, n_layers]
    else:
        per_stage = cfg.pipeline_parallel_layers_per_stage
        if per_stage == -1:
            n_stages = pp_size * (2 if is_multi_stage(schedule) else 1)
        else:
            n_stages = math.ceil(n_layers / per_stage)
        if n_stages > n_layers:
            raise ConfigError(
                f"{n_stages} pipeline stages for {n_layers} blocks: lower {flag}_degree "
                f"or raise {flag}_layers_per_stage"
            )
        # Even spread; the first stages take one extra block where it does not divide.
        sizes = [n_layers // n_stages + (1 if i < n_layers % n_stages else 0) for i in range(n_stages)]
        bounds = [sum(sizes[:i]) for i in range(n_stages + 1)]
    n_stages = len(bounds) - 1
    if not is_multi_stage(schedule) and n_stages != pp_size:
        raise ConfigError(
            f"{flag}_schedule {schedule} runs one stage per rank, but the split gives {n_stages} stages for "
            f"{pp_size} ranks; use a multi-stage schedule (e.g. Interleaved1F1B) or change the split"
        )
    if schedule in V_SCHEDULES and n_stages != 2 * pp_size:
        raise ConfigError(f"{flag}_schedule {schedule} needs exactly 2 stages per rank; the split gives {n_stages}")
    if n_stages % pp_size:
        raise ConfigError(f"the split gives {n_stages} stages, which is not a multiple of {flag}_degree {pp_size}")
    return [layer_names[bounds[i] : bounds[i + 1]] for i in range(n_stages)]


def keep_only(model: nn.Module, layers: list[str], first: bool, last: bool) -> nn.Module:
    """A copy of the meta ``model`` holding only ``layers`` (+ the embedding if ``first``, the head if ``last``)."""
    part = copy.deepcopy(model)  # on meta: no memory
    for name in list(part.layers):
        if name not in layers:
            del part.layers[name]
    if not first:
        part.tok_embeddings = None
    if not last:
        part.norm = None
        part.output = None
    return part


@dataclass
class Pipeline:
    """This rank's stages, their schedule, and the container of its parameters (``model``)."""

    model: nn.Module
    parts: list[nn.Module]
    stage_ids: list[int]
    n_stages: int
    pp_group: dist.ProcessGroup
    schedule: object = None

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    def build_schedule(
        self,
        cfg: ParallelismSection,
        local_batch_size: int,
        device: torch.device,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    ) -> None:
        """Wrap the materialized stages in the configured schedule.

        ``loss_fn(last stage output, rows)`` gets the indices of the rows of the step's batch that the
        pipeline microbatch holds (so the caller can hand its loss every key of those rows) and returns
        the loss to backpropagate. None: a forward-only pipeline (``forward``), e.g. a frozen reference.
        """
        mbs = cfg.pipeline_parallel_microbatch_size
        check_microbatches(cfg, local_batch_size)
        stages = [
            _Stage(part, sid, self.n_stages, device, group=self.pp_group)
            for part, sid in zip(self.parts, self.stage_ids)
        ]
        cls = get_schedule_class(cfg.pipeline_parallel_schedule)
        n_microbatches = local_batch_size // mbs
        try:
            # scale_grads=False: the loss is already divided by the step's global unit count.
            self.schedule = cls(
                stages[0] if issubclass(cls, PipelineScheduleSingle) else stages,
                n_microbatches=n_microbatches,
                loss_fn=loss_fn,
                scale_grads=False,
            )
        except ValueError as e:  # e.g. too few microbatches for the schedule
            raise ConfigError(
                f"--parallelism.pipeline_parallel_schedule {cfg.pipeline_parallel_schedule} with {n_microbatches} "
                f"microbatches (training.local_batch_size / pipeline_parallel_microbatch_size) and "
                f"{self.n_stages} stages: {e}"
            ) from None

    def _args(self, inputs: dict[str, torch.Tensor]) -> tuple[tuple, dict]:
        # The schedule feeds positional args to the first stage only, and kwargs to every stage:
        # the tokens go to the first stage; positions and document ids (which every stage's attention
        # needs: context parallelism, packed samples) go to all.
        kwargs = {k: v for k, v in inputs.items() if k != "tokens"}
        args = (inputs["tokens"],) if self.has_first_stage else ()
        return args, kwargs

    def step(self, inputs: dict[str, torch.Tensor], backward: bool = True) -> list[torch.Tensor]:
        """Forward and backward of one batch through all stages; the last stage's losses (else []).
        ``backward=False``: the same schedule forward only, still computing the losses (validation)."""
        args, kwargs = self._args(inputs)
        losses: list[torch.Tensor] = []
        if self.has_last_stage:
            rows = torch.arange(inputs["tokens"].shape[0], device=inputs["tokens"].device)
            kwargs.update(target=rows, losses=losses)
        run = self.schedule.step if backward else self.schedule.eval
        run(*args, return_outputs=False, **kwargs)  # (the last stage keeps no logits of its microbatches)
        return losses

    @torch.no_grad()
    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Forward only (no loss, no backward); the last stage's output for the whole batch, else None."""
        args, kwargs = self._args(inputs)
        out = self.schedule.eval(*args, **kwargs)
        return out if self.has_last_stage else None


def check_untied(args: Any) -> None:
    """The input embedding and the output projection live on different stages: they cannot be one weight."""
    if args.tie_word_embeddings:
        raise ConfigError(
            "--parallelism.pipeline_parallel_degree > 1 with tied embeddings (input embedding = output "
            "projection on different stages) is not supported; use 1"
        )


def check_microbatches(cfg: ParallelismSection, local_batch_size: int) -> None:
    """A pipeline microbatch divides the batch."""
    mbs = cfg.pipeline_parallel_microbatch_size
    if local_batch_size % mbs:
        raise ConfigError(
            f"--training.local_batch_size {local_batch_size} must be a multiple of "
            f"--parallelism.pipeline_parallel_microbatch_size {mbs}"
        )


def check_pipeline(model: nn.Module, pp_size: int, cfg: ParallelismSection, local_batch_size: int) -> None:
    """What ``build_pipeline`` and ``build_schedule`` refuse of the (meta) ``model`` and the config, before any
    process starts (titanium.preflight): tied embeddings, a split that does not fit the schedule, a microbatch
    size that does not divide the batch."""
    check_untied(model.args)
    split_layers(list(model.layers), pp_size, cfg)
    check_microbatches(cfg, local_batch_size)


def build_pipeline(
    model: nn.Module,
    pp_mesh: DeviceMesh,
    cfg: ParallelismSection,
    parallelize: Callable[[nn.Module], None],
) -> Pipeline:
    """Cut ``model`` (meta) into stages, keep this rank's, and parallelize each with ``parallelize``."""
    pp_rank, pp_size = pp_mesh.get_local_rank(), pp_mesh.size()
    check_untied(model.args)
    stages = split_layers(list(model.layers), pp_size, cfg)
    ids = stage_ids_of_rank(cfg.pipeline_parallel_schedule, pp_rank, pp_size, len(stages))
    parts = [keep_only(model, stages[i], i == 0, i == len(stages) - 1) for i in ids]
    for part in parts:
        parallelize(part)
    # The container: the original module, holding exactly this rank's (parallelized) submodules.
    model.layers = nn.ModuleDict(
        sorted(((k, v) for part in parts for k, v in part.layers.items()), key=lambda kv: int(kv[0]))
    )
    model.tok_embeddings = next((p.tok_embeddings for p in parts if p.tok_embeddings is not None), None)
    model.norm = next((p.norm for p in parts if p.norm is not None), None)
    model.output = next((p.output for p in parts if p.output is not None), None)
    return Pipeline(model=model, parts=parts, stage_ids=ids, n_stages=len(stages), pp_group=pp_mesh.get_group())
