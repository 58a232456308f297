"""Peak memory of one rank, estimated from a fake-tensor trace of training steps under the job's real plan.

How. This rank's model (or its pipeline stages) is built by the plan training uses (TP with sequence and loss
parallelism, CP, activation checkpointing, FSDP with its mixed precision) from fake tensors: shapes and dtypes,
no memory. Two optimizer steps run on it, each one microbatch (two when the step accumulates gradients): the
forward, the cross-entropy (from the logits, or chunked with training.loss_chunk_size), the backward, gradient
clipping, the optimizer step. A dispatch mode sees every tensor the steps make and adds up the bytes of the
storages alive at each moment (FSDP resizes its gathered parameters outside the dispatcher; those resizes are
counted too). The peak of the second step is the steady state, with the parameters, gradients and optimizer
states in it; what is alive at that moment is the breakdown, labelled by the module whose forward made it.

Depth. All blocks are alike, so the trace builds 3 and then 4 blocks per stage (3N and 4N when every N-th block is
checkpointed) and extrapolates linearly to the real depth, which keeps a 405B plan to seconds. The step has two
kinds of high points, and each is extrapolated on its own: until the backward has left the blocks, every block's
activations are alive (the high grows by a block's parameters, states and activations per block); afterwards
(the embedding's gradient, the last reduce-scatters, the optimizer step) only the per-block parameters, gradients
and states remain. Each trace records the high of both phases with what is alive at it.

Pipelines. The trace runs one microbatch through each of this rank's stages and measures what each stage's
forward leaves alive for its backward. Torch's own action list of the configured schedule then says how many
microbatches each stage holds at once, and the extra ones are added at the worst moment.

MoE models. Routing decides how many rows each expert (and, under expert parallelism, each rank) gets, which fake
tensors cannot know and a trace must not depend on: the experts run as if routing were balanced (every expert the
same number of rows, the GPU's grouped GEMM), and under expert parallelism this rank receives ``moe_imbalance``
times its even share of the routed rows (the busiest rank; dry_run's ``--moe_imbalance``).

Not modelled: torch.compile (compiled blocks usually save less), the allocator's caching and fragmentation and the
CUDA context (PyTorch reserves more than it allocates: keep some headroom), kernels' internal workspaces and NCCL's
buffers, and what an objective adds beyond a cross-entropy on the logits (the dry run adds the parameters of the
frozen models an objective builds, a teacher or a reference, as ``FROZEN``, the parameters and AdamW states of a
model it trains beside the policy, PPO's value model, as ``TRAINED``, and the titanium rollout engine's copy of the
policy as ``ENGINE``; ``estimate_memory`` adds that model's gradients and the activations its forward in the loss
keeps for its backward (the trace's own forward activations without the output projection and the loss) where they
are alive; not the frozen models' forward's activations, which are gone before the step's forward starts, nor a copy
an objective keeps, such as the kd teacher's whole output projection). The trace runs CPU kernels; GPU attention
kernels save about as much (the output and its log-sum-exp).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import unittest.mock
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_leaves

from titanium.batch import Batch
from titanium.config.components import JobConfig
from titanium.models.common.moe import expert_swiglu, grouped_gemm_kind, moe_layers
from titanium.models.converter import ModelConverter, apply_converters, set_trainable
from titanium.models.spec import ModelSpec
from titanium.objectives.base import ModelOutput
from titanium.objectives.losses.cross_entropy import TokenCrossEntropy, TokenFields
from titanium.optim import build_optimizer
from titanium.optim.optimizer import LOW_BIT
from titanium.parallel.dims import Meshes, ParallelDims
from titanium.parallel.expert import ExpertParallelExperts
from titanium.parallel.grad_norm import clip_grad_norm
from titanium.parallel.parallelize import PlanConfig, parallelize_decoder
from titanium.parallel.pipeline import Pipeline, keep_only

GIB = 2**30

PARAMETERS, GATHERED, GRADIENTS, OPTIMIZER = (
    "parameters",
    "parameters gathered by FSDP",
    "gradients",
    "optimizer states",
)
BACKWARD = "backward: activation gradients, recomputation, reduce-scatter buffers"
IN_FLIGHT = "activations of the other microbatches a pipeline stage holds"
FROZEN = "frozen models' parameters (a teacher, a reference)"
TRAINED = "other trained models' parameters and AdamW states (PPO's value model)"
ENGINE = "the rollout engine's copy of the policy (titanium engine)"
BESIDE = "activations of the models trained beside the policy (PPO's value model)"
BESIDE_GRADIENTS = "gradients of the models trained beside the policy (PPO's value model)"
HEAD_LABELS = ("activations: output", "activations: loss")
"""What a forward makes for the vocabulary: the output projection's logits and the loss on them."""


@dataclass(frozen=True)
class Job:
    """What the trace needs to know about the job and this rank."""

    cfg: JobConfig
    dims: ParallelDims
    meshes: Meshes
    plan: PlanConfig
    spec: ModelSpec
    args: Any
    converters: Callable[[], list[ModelConverter]]
    """Fresh converters for each traced model (they may keep state per model)."""
    autocast: Callable[[], contextlib.AbstractContextManager]
    stages: list[tuple[bool, bool, int]]
    """This rank's stages in order: (holds the embedding, holds the output, number of blocks)."""
    rows: int
    """Sequences per microbatch that one forward sees (the pipeline microbatch under PP)."""
    accumulation: int
    """Microbatches per optimizer step (pipeline microbatches included)."""
    device_type: str = "cuda"
    """The device whose kernels the trace assumes where it matters (the MoE experts' grouped GEMM)."""
    moe_imbalance: float = 1.25
    """MoE under expert parallelism: rows this rank receives, over its share under perfectly balanced routing."""


REGIONS = ("blocks", "after blocks")
"""The two phases of a step whose highs scale differently with depth: until the backward has left the blocks
(every block's activations alive), and from then on (embedding gradient, last reduce-scatters, optimizer step)."""


@dataclass
class Trace:
    peaks: dict[str, float]
    """Per region: the highest number of live bytes."""
    parts: dict[str, dict[str, float]]
    """Per region: what was alive at that high, by label."""
    saved: list[float]
    """Per stage: the bytes one microbatch's forward leaves alive for its backward."""
    body: list[float]
    """Per stage: of ``saved``, the activations of the body (without the output projection's logits and the loss)."""


@dataclass
class MemoryEstimate:
    peak: float
    """Bytes."""
    parts: list[tuple[str, float]]
    """What is alive at the peak, largest first."""
    depths: tuple[int, ...]
    """Blocks per stage in the traces (one trace: the real depth)."""
    held: list[int] | None = None
    """Pipelines: microbatches each stage holds at the worst moment."""
    seconds: float = 0.0
    body_activations: float = 0.0
    """One microbatch's forward activations of this rank's stages without the vocabulary's logits and loss: what a
    model of the policy's shape with a small head (PPO's value model) keeps for its backward."""

    def report(self, device_memory_gib: float, top: int = 8) -> Iterator[str]:
        peak = self.peak / GIB
        share = 100 * peak / device_memory_gib
        if peak > device_memory_gib:
            verdict = "DOES NOT FIT"
        else:
            verdict = "fits" if share <= 90 else "fits, tightly (the allocator needs some headroom)"
        if len(self.depths) == 2:
            traced = f"at {self.depths[0]} and {self.depths[1]} blocks per stage, extrapolated"
        else:
            traced = "at the real depth"
        yield (
            f"memory per rank (estimate: fake-tensor trace of two steps {traced}; eager, no compile; "
            f"{self.seconds:.1f}s):"
        )
        yield f"  peak {peak:.2f} GiB = {share:.0f}% of {device_memory_gib:g} GiB: {verdict}"
        if self.held is not None:
            yield f"  pipeline: at the worst moment this rank's stages hold {self.held} microbatches' activations"
        for name, nbytes in self.parts[:top]:
            yield f"    {nbytes / GIB:9.3f} GiB  {name}"
        rest = sum(b for _, b in self.parts[top:])
        if rest:
            yield f"    {rest / GIB:9.3f} GiB  other"

    def plus(self, name: str, nbytes: float) -> MemoryEstimate:
        """This estimate with ``nbytes`` more alive at the peak, as the part ``name``."""
        parts = sorted([*self.parts, (name, nbytes)], key=lambda kv: -kv[1])
        return dataclasses.replace(self, peak=self.peak + nbytes, parts=parts)

    def fits(self, device_memory_gib: float) -> bool:
        return self.peak / GIB <= device_memory_gib


def estimate_memory(
    job: Job, pipeline: Pipeline | None = None, beside: int = 0, beside_gradients: float = 0.0
) -> MemoryEstimate:
    """Trace, extrapolate to the real depth, and add a pipeline's in-flight microbatches and what ``beside`` models of
    the policy's shape trained in the policy's loss (PPO's value model) hold beyond their parameters and optimizer
    states: their gradients (``beside_gradients`` bytes) and their forward's activations (one microbatch, as the
    policy's body's). Their forward runs after the policy's and their backward first, so before the backward leaves
    the blocks they hold their activations or, as their backward turns those into gradients, their gradients (both,
    when the step accumulates gradients); afterwards only their gradients (the optimizer steps)."""
    start = time.perf_counter()
    period = _checkpoint_period(job.cfg)
    blocks = [n for _, _, n in job.stages]
    if max(blocks) <= 4 * period:  # small enough to trace as it is
        depths: tuple[int, ...] = (max(blocks),)
        trace = trace_steps(job, blocks)
    else:  # (from 3 blocks on, FSDP's prefetching of the next block is in its steady state)
        d1, d2 = 3 * period, 4 * period
        depths = (d1, d2)
        a, b = trace_steps(job, [d1] * len(blocks)), trace_steps(job, [d2] * len(blocks))
        factor = (sum(blocks) / len(blocks) - d1) / (d2 - d1)  # (every stage grew by d2 - d1 blocks)
        trace = Trace(
            peaks={r: _lerp(a.peaks[r], b.peaks[r], factor) for r in REGIONS},
            parts={r: _lerp_parts(a.parts[r], b.parts[r], factor) for r in REGIONS},
            saved=[_lerp(x, y, (n - d1) / (d2 - d1)) for x, y, n in zip(a.saved, b.saved, blocks)],
            body=[_lerp(x, y, (n - d1) / (d2 - d1)) for x, y, n in zip(a.body, b.body, blocks)],
        )
    if beside:
        _add_beside(trace, beside * sum(trace.body), beside_gradients, job.accumulation)
    region = max(REGIONS, key=lambda r: trace.peaks[r])
    peak, parts = trace.peaks[region], dict(trace.parts[region])
    held = None
    if pipeline is not None:  # the stages' other microbatches are alive in both regions
        states = held_microbatches(pipeline, job.rows, job.cfg.training.local_batch_size)
        worst = max(states, key=lambda counts: sum(c * s for c, s in zip(counts, trace.saved)))
        held = list(worst)
        extra = sum(c * s for c, s in zip(worst, trace.saved)) - sum(trace.saved)
        peak += extra
        parts[IN_FLIGHT] = extra
    ranked = sorted(((k, v) for k, v in parts.items() if v > 0), key=lambda kv: -kv[1])
    return MemoryEstimate(peak, ranked, depths, held, time.perf_counter() - start, sum(trace.body))


def _add_beside(trace: Trace, activations: float, gradients: float, accumulation: int) -> None:
    """Add the activations and gradients of the models trained beside the policy to the regions' highs where they
    are alive (see ``estimate_memory``)."""
    blocks = {BESIDE: activations, BESIDE_GRADIENTS: gradients}
    if accumulation == 1:  # (one or the other: their backward frees the activations as it makes the gradients)
        blocks = dict([max(blocks.items(), key=lambda kv: kv[1])])
    for region, extra in ((REGIONS[0], blocks), (REGIONS[1], {BESIDE_GRADIENTS: gradients})):
        trace.peaks[region] += sum(extra.values())
        trace.parts[region].update(extra)


def _lerp(x: float, y: float, factor: float) -> float:
    return x + factor * (y - x)


def _lerp_parts(a: dict[str, float], b: dict[str, float], factor: float) -> dict[str, float]:
    return {k: max(0.0, _lerp(a.get(k, 0.0), b.get(k, 0.0), factor)) for k in a | b}


def _checkpoint_period(cfg: JobConfig) -> int:
    """Blocks after which the plan repeats: N when every N-th block is checkpointed, else 1."""
    ac = cfg.activation_checkpoint
    return int(ac.selective_ac_option) if ac.mode == "selective" and ac.selective_ac_option != "op" else 1


def held_microbatches(pipeline: Pipeline, rows: int, local_batch_size: int) -> list[tuple[int, ...]]:
    """For each action of this rank in the schedule: how many microbatches' activations each of its stages holds
    (a forward adds one; a full backward, or the weight half of a split one, frees one)."""
    ids = pipeline.stage_ids
    order = getattr(pipeline.schedule, "pipeline_order", None)
    n_microbatches = local_batch_size // rows
    if not order:  # single-stage schedules of torch versions without an action list
        gpipe = type(pipeline.schedule).__name__ == "ScheduleGPipe"
        return [(n_microbatches if gpipe else min(n_microbatches, pipeline.n_stages - ids[0]),)]
    pp_rank = pipeline.pp_group.rank()
    held = dict.fromkeys(ids, 0)
    states: list[tuple[int, ...]] = []

    def apply(action: Any) -> None:
        kind = action.computation_type.value
        if action.sub_actions:  # an overlapped forward and backward: the forward first, conservatively
            for sub in action.sub_actions:
                apply(sub)
            return
        if kind == "F":
            held[action.stage_index] += 1
        elif kind in ("B", "W"):
            held[action.stage_index] -= 1
        states.append(tuple(held[i] for i in ids))

    for action in order[pp_rank]:
        if action is not None:
            apply(action)
    return states or [tuple(1 for _ in ids)]


# ----- the trace -----


def trace_steps(job: Job, depths: list[int]) -> Trace:
    """Two optimizer steps of this rank's stages, built with ``depths`` blocks each, on fake tensors."""
    parts = _build_parts(job, depths)
    if job.cfg.optimizer.name in LOW_BIT:
        _build_low_bit_maps()
    with FakeTensorMode(allow_non_fake_inputs=True):
        for part in parts:
            part.to_empty(device="cpu")
            part.init_buffers("cpu")
        container = nn.ModuleList(parts)
        optimizer = build_optimizer(container, job.cfg.optimizer)
        params = list(container.parameters())
        tracker = _LiveStorages()
        for t in [*params, *container.buffers()]:
            tracker.add(t, PARAMETERS)
        saved: list[float] = []
        body: list[float] = []
        with (
            tracker,
            _module_labels(tracker, parts),
            _resizes_counted(tracker),
            _sharding_propagation_uncounted(tracker),
            _eager_low_bit_step(job),  # (with early_step_in_backward the steps run inside the backward)
        ):
            # As in the trainer: autocast (mixed precision without FSDP) around each forward, or, under PP, around
            # the whole schedule, backward included (its cache of low-precision weights lives that long).
            pipelined = job.plan.pipeline
            forward_autocast = contextlib.nullcontext if pipelined else job.autocast
            for step in range(2):
                with job.autocast() if pipelined else contextlib.nullcontext():
                    for microbatch in range(min(job.accumulation, 2)):
                        saved_now, body_now = _microbatch(job, parts, tracker, forward_autocast)
                        tracker.learn_roles(params, optimizer)
                        if step == 1 and microbatch == 0:
                            saved, body = saved_now, body_now
                tracker.phase = "optimizer step"
                tracker.set_region(REGIONS[1])
                trainable = [p for p in params if p.grad is not None]
                clip_grad_norm(trainable, job.cfg.training.max_norm)  # (per mesh: experts may have their own)
                optimizer.step()
                tracker.learn_roles(params, optimizer)
                optimizer.zero_grad(set_to_none=True)
                if step == 0:
                    tracker.reset_peak()
        peaks, parts_at_peaks = tracker.peaks(), tracker.peak_parts()
    return Trace(peaks, parts_at_peaks, saved, body)


def _build_low_bit_maps() -> None:
    """torchao's 8- and 4-bit optimizer states make their quantization maps on first use, from Python numbers
    (``.tolist()``), which fake tensors cannot give; making them here first (they are cached) lets the trace run."""
    from torchao.optim import subclass_4bit, subclass_8bit

    for states in (subclass_8bit, subclass_4bit):
        states.get_qmap_signed()
        states.get_qmap_unsigned()


def _eager_low_bit_step(job: Job) -> contextlib.AbstractContextManager:
    """torchao's low-bit AdamW steps each parameter in a compiled function, which cannot trace fake tensors; run it
    eagerly instead (its per-parameter temporaries are then counted unfused: a slight overestimate)."""
    if job.cfg.optimizer.name not in LOW_BIT:
        return contextlib.nullcontext()
    return unittest.mock.patch.object(torch, "compile", lambda fn, **_: fn)  # torchao compiles at each step call


def _build_parts(job: Job, depths: list[int]) -> list[nn.Module]:
    """This rank's stages with ``depths`` blocks each, on meta, converted and parallelized as training does."""
    parts = []
    for (first, last, _), depth in zip(job.stages, depths):
        with torch.device("meta"):
            model = job.spec.model_cls(dataclasses.replace(job.args, n_layers=depth))
        converters = job.converters()
        apply_converters(converters, model)
        part = keep_only(model, list(model.layers), first, last)
        parallelize_decoder(part, job.dims, job.meshes, job.plan, tp_plan=job.spec.tp_plan)
        _assume_balanced_routing(part, job)
        set_trainable(converters, part)
        part.train()
        parts.append(part)
    return parts


def _assume_balanced_routing(part: nn.Module, job: Job) -> None:
    """MoE layers: the experts get equal numbers of rows (and, under expert parallelism, this rank receives
    ``job.moe_imbalance`` times its share), so no shape depends on routing decisions fake tensors do not make."""

    def balanced(x: torch.Tensor, counts: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        n, experts = x.shape[0], weights[0].shape[0]
        sizes = [n // experts + (1 if e < n % experts else 0) for e in range(experts)]
        kind = grouped_gemm_kind(x, weights[0], job.device_type)
        return expert_swiglu(x, counts, *weights, kind=kind, sizes=sizes)

    for moe in moe_layers(part).values():
        moe.experts.compute = balanced  # type: ignore[method-assign]
        if isinstance(moe.experts, ExpertParallelExperts):
            moe.experts.assumed_imbalance = job.moe_imbalance


def _microbatch(
    job: Job, parts: list[nn.Module], tracker: _LiveStorages, autocast: Callable[[], contextlib.AbstractContextManager]
) -> tuple[list[float], list[float]]:
    """Forward (and loss) through the stages, then backward; returns what each stage's forward left alive, all of it
    and its body's activations (without the output projection's and the loss's)."""
    dims, seq = job.dims, job.cfg.training.seq_len // job.dims.cp
    dim = job.args.decoder_args().dim
    sharded_loss = loss_parallel if dims.loss_parallel_enabled else contextlib.nullcontext
    hidden_dtype = job.plan.param_dtype if dims.fsdp_enabled else torch.float32
    outputs, saved, body, kept = [], [], [], []
    loss = TokenCrossEntropy(job.cfg.training.loss_chunk_size)
    tracker.set_region(REGIONS[0])

    def leaving_blocks(module: nn.Module, args: tuple) -> None:
        # The gradient of the first block's input is the backward's last step through the blocks.
        if tracker.phase == "forward" and args[0].requires_grad:
            args[0].register_hook(lambda grad: tracker.set_region(REGIONS[1]))

    first_block = next(iter(parts[0].layers.values()))
    handle = first_block.register_forward_pre_hook(leaving_blocks)
    for part, (first, last, _) in zip(parts, job.stages):
        before = set(tracker.live)  # (what the stage holds for its backward includes its input)
        tracker.phase = "inputs"
        kwargs = _position_inputs(job, seq)
        if first:
            x = torch.randint(0, job.args.vocab_size, (job.rows, seq))
        else:  # the previous stage's output as the pipeline receives it: this rank's sequence shard
            x = torch.empty(job.rows, seq // dims.tp, dim, dtype=hidden_dtype, requires_grad=True)
        labels = torch.randint(0, job.args.vocab_size, (job.rows, seq)) if last else None
        tracker.phase = "forward"
        with sharded_loss(), autocast():
            if not last:
                out = part(x, **kwargs)
            else:  # the pretrain/SFT loss: from the logits, or chunk by chunk from the hidden states
                if loss.loss_input == "hidden":
                    output = ModelOutput(hidden=part(x, project=False, **kwargs), projection=part.output)
                else:
                    output = ModelOutput(logits=part(x, **kwargs))
                tracker.module = "loss"
                if job.plan.pipeline:  # a stage keeps its output until its backward (the trainer lets go of it)
                    kept.append(output)
                batch = Batch(labels, TokenFields(labels, label_index=torch.arange(labels.numel())))  # (all labelled)
                out = loss(output, batch)
                out = out.full_tensor() if isinstance(out, DTensor) else out
                tracker.module = None
                del output
        made = [(n, label) for k, (n, label, _) in tracker.live.items() if k not in before and label != GATHERED]
        saved.append(float(sum(n for n, _ in made)))
        body.append(float(sum(n for n, label in made if label.startswith("activations") and label not in HEAD_LABELS)))
        outputs.append(out)
    handle.remove()
    tracker.phase = "backward"
    for out, (_, last, _) in reversed(list(zip(outputs, job.stages))):
        with sharded_loss():
            out.backward() if last else out.backward(torch.ones_like(out))
    return saved, body


def _position_inputs(job: Job, seq: int) -> dict[str, torch.Tensor]:
    """Positions under CP (global ones travel with the batch); packed SFT rows also carry document ids."""
    kwargs = {}
    packed = job.cfg.training.objective == "sft" and job.cfg.sft.packing
    if job.dims.cp > 1 or packed:
        kwargs["positions"] = torch.arange(seq).expand(job.rows, -1)
    if packed:
        kwargs["document_ids"] = torch.zeros(job.rows, seq, dtype=torch.long)
    return kwargs


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind a tensor, looking through wrapper subclasses (DTensor)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, name) for name in names]
        return [s for x in inner if isinstance(x, torch.Tensor) for s in _storages(x)]
    return [t.untyped_storage()]


class _LiveStorages(TorchDispatchMode):
    """Bytes of the live storages of every tensor made while active, labelled by who made them, and their peak.

    A storage is forgotten when it is freed (a weak reference's callback, where no tensor may be touched). What is
    alive is copied at the peak itself (when memory first goes down after a new high); storages whose role shows
    only later (a gradient, an optimizer state) are named at safe points (``learn_roles``) by their serial number,
    which, unlike a storage's address, is never reused."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[int, str, int]] = {}  # storage address -> (bytes, label, serial)
        self._refs: dict[int, weakref.ref] = {}
        self._serial = 0
        self.total = 0
        self.region = REGIONS[0]
        self._peak = dict.fromkeys(REGIONS, 0)
        self._at_peak: dict[str, list[tuple[int, int, str]]] = {r: [] for r in REGIONS}  # (serial, bytes, label)
        self._pending = False
        self.roles: dict[int, str] = {}  # serial -> role
        self.phase = "inputs"
        self.module: str | None = None
        self.paused = 0
        """Above 0: tensors made now are not the rank's (DTensor's sharding propagation), and are not counted."""

    @property
    def label(self) -> str:
        if self.phase == "forward":
            return f"activations: {self.module or 'model'}"
        return BACKWARD if self.phase == "backward" else self.phase

    def add(self, t: torch.Tensor, label: str) -> None:
        for storage in _storages(t):
            if storage._cdata not in self.live:
                self._set(storage, storage.nbytes(), label)

    def resized(self, storage: torch.UntypedStorage) -> None:
        self._set(storage, storage.nbytes(), GATHERED)

    def set_region(self, region: str) -> None:
        self._before_decrease()  # (a high of the region being left is complete)
        self.region = region
        self._raise_peak()

    def _set(self, storage: torch.UntypedStorage, nbytes: int, label: str) -> None:
        key = storage._cdata
        old, _, serial = self.live.get(key, (0, "", -1))
        if nbytes < old:
            self._before_decrease()
        if serial < 0:
            self._serial += 1
            serial = self._serial
            self._refs[key] = weakref.ref(storage, partial(self._freed, key))
        self.live[key] = (nbytes, label, serial)
        self.total += nbytes - old
        self._raise_peak()

    def _raise_peak(self) -> None:
        if self.total > self._peak[self.region]:
            self._peak[self.region], self._pending = self.total, True

    def _freed(self, key: int, _ref: weakref.ref) -> None:
        self._before_decrease()
        nbytes = self.live.pop(key, (0, "", -1))[0]
        self._refs.pop(key, None)
        self.total -= nbytes

    def _before_decrease(self) -> None:
        if self._pending:  # memory is about to fall from a new high: keep what is alive now
            self._pending = False
            self._at_peak[self.region] = [(serial, nbytes, label) for nbytes, label, serial in self.live.values()]

    def reset_peak(self) -> None:
        """Start new peak windows now (the second step's)."""
        self._before_decrease()
        self._peak = dict.fromkeys(REGIONS, 0)
        self._raise_peak()

    def learn_roles(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        """Name the storages that are gradients or optimizer states now (call between operations)."""
        tensors = [(p.grad, GRADIENTS) for p in params if p.grad is not None]
        for state in optimizer.state.values():
            tensors += [(v, OPTIMIZER) for v in state.values() if isinstance(v, torch.Tensor)]
        for t, role in tensors:
            for storage in _storages(t):
                if (entry := self.live.get(storage._cdata)) is not None:
                    self.roles[entry[2]] = role

    def peaks(self) -> dict[str, float]:
        return {r: float(v) for r, v in self._peak.items()}

    def peak_parts(self) -> dict[str, dict[str, float]]:
        self._before_decrease()
        out = {}
        for region, alive in self._at_peak.items():
            parts: dict[str, float] = defaultdict(float)
            for serial, nbytes, label in alive:
                parts[self.roles.get(serial, label)] += nbytes
            out[region] = dict(parts)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(t is not torch.Tensor and is_traceable_wrapper_subclass_type(t) for t in types):
            # A DTensor op: let DTensor run it, so that the local operations it makes (redistributions
            # included) come back here one by one; their outputs are what the DTensor holds.
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.add(t, self.label)
        return out


@contextlib.contextmanager
def _module_labels(tracker: _LiveStorages, parts: list[nn.Module]) -> Iterator[None]:
    """Keep ``tracker.module`` on the innermost named module running its forward (``layers.*.attention``)."""
    names = {}
    for part in parts:
        for name, module in part.named_modules():
            if name:
                names[module] = _group_name(name)
    stack: list[str | None] = []

    def pre(module: nn.Module, args: Any) -> None:
        stack.append(tracker.module)
        tracker.module = names.get(module, tracker.module)

    def post(module: nn.Module, args: Any, output: Any) -> None:
        tracker.module = stack.pop() if stack else None

    handles = [
        nn.modules.module.register_module_forward_pre_hook(pre),
        nn.modules.module.register_module_forward_hook(post),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _group_name(name: str) -> str:
    """``layers.7._checkpoint_wrapped_module.attention.wq`` -> ``layers.*.attention``: one row per kind of part."""
    parts = [p for p in name.split(".") if not p.startswith("_")]
    if parts[0] == "layers":
        return ".".join(["layers", "*", *parts[2:3]])
    return parts[0]


@contextlib.contextmanager
def _resizes_counted(tracker: _LiveStorages) -> Iterator[None]:
    """FSDP allocates and frees its gathered parameters with ``UntypedStorage.resize_``, which the dispatcher does
    not see: wrap it for the duration of the trace (torch's own memory tracker does the same)."""
    original = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        out = original(storage, size)
        tracker.resized(storage)
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _sharding_propagation_uncounted(tracker: _LiveStorages) -> Iterator[None]:
    """DTensor finds an op's output shape by running the op on fake tensors of the *global* shapes. torch 2.13
    caches that per op and input layout, so it runs in the first step only; torch 2.11 runs it at every op (under
    a fake mode it does not cache), and a 70B plan's global-shape temporaries would count as this rank's memory
    (1,040 GiB instead of 60). Those tensors are never the rank's: stop counting while they exist."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def uncounted(self: ShardingPropagator, *args: Any, **kwargs: Any) -> Any:
        tracker.paused += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            tracker.paused -= 1

    with unittest.mock.patch.object(ShardingPropagator, "_propagate_tensor_meta_non_cached", uncounted):
        yield
