"""Dry run: build a job's parallel plan for any world size on one CPU, and estimate its peak memory per rank.

    python -m titanium.tools.dry_run --job.config_file train_configs/llama3_405b.toml --world_size 512

A fake process group stands in for the cluster, so the mesh, the TP plan, FSDP sharding and the pipeline
schedule are built exactly as rank ``--rank`` would build them, on the meta device (nothing is allocated),
after the checks titanium.train makes before it starts (compile settings checked for ``--device_type``,
default cuda). The report lists each parameter's placements and local shard shape, then the estimated peak
memory of the rank and what fills it (titanium/tools/memory_estimate.py says how), against
``--device_memory_gib`` (default 78: about what PyTorch gets of an 80 GB H100). Exit code 0: the plan is valid
and fits; 1: it does not fit; 2: the plan is invalid. ``--no_memory`` skips the estimate. The tokenizer is not
read: the vocabulary is the flavor's, or, for a run that starts from a Hugging Face folder
(``--checkpoint.initial_load_in_hf``), the architecture and vocabulary are its config.json's (no weights are read).
For MoE models the estimate assumes balanced routing, with the busiest expert-parallel rank receiving
``--moe_imbalance`` (default 1.25) times its even share of the routed tokens.

The trained model is the objective's (``Objective.policy_spec``: a reward model's scalar head), and the frozen models
the objective builds (``Objective.frozen_sources``: a kd teacher, a DPO, KTO, GRPO or PPO reference, PPO's reward
model) are built by the same plan and their parameters on this rank added to the estimate; a reference that is the
policy itself with its LoRA switched off costs nothing. The models the objective trains beside the policy
(``Objective.trainable_sources``: PPO's value model, with its own AdamW) add their parameters and two AdamW moments
on this rank, and, as their forward runs in the policy's loss (both backwards are one), their gradients and the
activations their forward keeps for the backward where they are alive (``estimate_memory``): the policy's own trace's
forward activations without the output projection and the loss (the value model is the policy's body with a
one-column head, on the same rows); an objective that generates with the ``[rollout]`` engine (GRPO, PPO) adds
titanium engine's own copy of the policy (the family's whole plain model in the engine's dtype, on every rank; a vLLM
engine's memory is its own and not counted).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from titanium.config import ConfigError, JobConfig, load_config
from titanium.config.components import OBJECTIVES
from titanium.config.sections import CompileSection
from titanium.data.tokenizer import build_tokenizer
from titanium.errors import UserError
from titanium.generation.tp_plan import shard_for_decoding
from titanium.inputs import resolve_inputs
from titanium.model_builder import DTYPES, BuiltModel, ModelBuilder, ModelSource
from titanium.model_handles import is_the_policy
from titanium.model_setup import job_converters, job_plan
from titanium.parallel.compile import check_compile
from titanium.parallel.dims import Meshes, ParallelDims
from titanium.parallel.params import clean_fqn
from titanium.parallel.pipeline import Pipeline
from titanium.precision import dtype_name
from titanium.preflight import check_job
from titanium.tools.memory_estimate import ENGINE, FROZEN, TRAINED, Job, MemoryEstimate, estimate_memory


@dataclass(frozen=True)
class ParamPlan:
    name: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    placements: str
    mesh_dims: tuple[str, ...]


@dataclass
class DryRun:
    cfg: JobConfig
    dims: ParallelDims
    meshes: Meshes
    model: nn.Module
    params: list[ParamPlan]
    stages: tuple[list[int], int] | None = None
    """(this rank's pipeline stages, number of stages), or None without pipeline parallelism."""
    job: Job | None = None
    """What the memory estimate traces."""
    pipeline: Pipeline | None = None
    frozen_bytes: int = 0
    """This rank's parameters of the frozen models the objective builds (a teacher, a reference)."""
    trained_bytes: int = 0
    """This rank's parameters, gradients and AdamW states of the models the objective trains beside the policy."""
    engine_bytes: int = 0
    """The rollout engine's copy of the policy on this rank (titanium's engine)."""
    trained_models: int = 0
    """How many models the objective trains beside the policy (their forward runs in the policy's loss)."""

    def described_model(self) -> str:
        """The model as the job resolved it: its family (and flavor), or the backend (and its config.json)."""
        if self.job is None:
            return f"{self.cfg.model.name} {self.cfg.model.flavor}"
        model, start = self.cfg.model, self.cfg.checkpoint
        folder = start.initial_load_path if start.initial_load_in_hf else model.hf_config
        return f"{self.job.spec.name} from {folder}" if folder else f"{self.job.spec.name} {model.flavor}"

    def estimate_memory(self) -> MemoryEstimate:
        assert self.job is not None
        gradients = self.trained_bytes // TRAINED_COPIES  # (alive part of the step: estimate_memory places them)
        estimate = estimate_memory(self.job, self.pipeline, self.trained_models, gradients)
        trained = self.trained_bytes - gradients
        extra = ((FROZEN, self.frozen_bytes), (TRAINED, trained), (ENGINE, self.engine_bytes))
        for name, nbytes in extra:
            estimate = estimate.plus(name, nbytes) if nbytes else estimate
        return estimate

    @property
    def local_numel(self) -> int:
        return sum(_numel(p.local_shape) for p in self.params)

    def report(self, every_block: bool = False) -> Iterator[str]:
        d = self.dims
        yield (
            f"world {d.world_size} = pp {d.pp} x dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} x "
            f"cp {d.cp} x tp {d.tp}; model {self.described_model()}"
            + (f"; compute dtype {dtype_name(self.job.plan.param_dtype)}" if self.job else "")
        )
        if d.ep > 1:
            efsdp = d.dp_shard * d.cp // d.ep
            yield f"expert parallel {d.ep} (borrowed from dp_shard x cp): experts sharded by FSDP over efsdp {efsdp}"
        if self.job is not None and self.job.args.decoder_args().moe is not None:
            yield (
                f"MoE routing assumed balanced; the busiest expert-parallel rank receives {self.job.moe_imbalance:g}x "
                "its even share of the routed tokens (--moe_imbalance)"
            )
        if self.stages is not None:
            ids, n = self.stages
            yield f"pipeline: stages {ids} of {n} on pp rank {self.meshes.pp.get_local_rank()}"
        yield f"{'parameter':<44} {'global shape':<18} {'mesh':<22} {'placements':<44} local shape"
        first_block = None
        for p in self.params:
            block = re.match(r"layers\.(\d+)\.", p.name)
            if block and not every_block:
                first_block = first_block or block.group(1)
                if block.group(1) != first_block:
                    continue
            mesh = ",".join(p.mesh_dims)
            yield (f"{p.name:<44} {str(list(p.global_shape)):<18} {mesh:<22} {p.placements:<44} {list(p.local_shape)}")
        if not every_block and first_block is not None:
            yield f"(blocks other than layers.{first_block} have the same plan; --every_block lists them all)"
        n = self.local_numel
        yield (
            f"per rank: {n / 1e9:.3f}B parameters = {n * 4 / 2**30:.2f} GiB fp32 weights, "
            f"{n * 4 / 2**30:.2f} GiB grads, {n * 8 / 2**30:.2f} GiB AdamW states"
        )


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _param_plan(name: str, param: torch.Tensor) -> ParamPlan:
    if isinstance(param, DTensor):
        return ParamPlan(
            name=name,
            global_shape=tuple(param.shape),
            local_shape=tuple(param.to_local().shape),
            placements=str(tuple(param.placements)),
            mesh_dims=tuple(param.device_mesh.mesh_dim_names or ()),
        )
    return ParamPlan(name, tuple(param.shape), tuple(param.shape), "(not distributed)", ())


def dry_run(
    argv: list[str], world_size: int, rank: int = 0, device_type: str = "cuda", moe_imbalance: float = 1.25
) -> DryRun:
    """Build the plan of rank ``rank`` of ``world_size`` on a fake process group (created and left
    initialized; call ``torch.distributed.destroy_process_group()`` when done), checking what training
    checks on ``device_type``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # The dry run never reads the tokenizer (the flavor or config.json gives the vocabulary), so it may be absent;
    # a Hugging Face start folder's own is used as in training.
    cfg = load_config(
        [*argv, "--tokenizer.kind", "byte"], resolve=lambda cfg, given: resolve_inputs(cfg, given - {"tokenizer.kind"})
    )
    dims = check_job(cfg, world_size, device_type, processor=False)  # (configs alone: no processor files)
    check_compile(cfg.compile, cfg.activation_checkpoint, dims.tp_enabled, device_type)
    # DTensor caches each op's output spec, mesh included, by its input specs, and meshes compare by ranks and dim
    # names, not by process groups: after an earlier dry run in this process (its fake group destroyed), this run's
    # parameters would land on that run's mesh ("Could not resolve the process group registered under the name N").
    _clear_sharding_prop_cache()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    meshes = dims.build_meshes("cpu")
    t = cfg.training
    # (compile is checked above; it places nothing, and the memory trace is eager)
    plan = job_plan(cfg, dims, device_type, compile=CompileSection())
    # The same builder as training, stopped before materialization: nothing is allocated.
    builder = ModelBuilder(torch.device("cpu"), cfg.debug.seed, dims, meshes, plan)
    spec, args = builder.resolve(cfg.model, seq_len=t.seq_len, checkpoint=cfg.checkpoint)
    hf_start = cfg.checkpoint.initial_load_path if cfg.checkpoint.initial_load_in_hf else None
    spec = OBJECTIVES.load(t.objective).policy_spec(spec, build_tokenizer(cfg.tokenizer), hf_start)
    converters = partial(job_converters, cfg, dims, device_type=None)
    built = builder.build(spec, args, converters=converters(), materialize=False)
    stage_ids, stages = None, [(True, True, args.n_layers)]
    if (pipeline := built.pipeline) is not None:
        pipeline.build_schedule(cfg.parallelism, t.local_batch_size, torch.device("cpu"), loss_fn=lambda out, rows: out)
        stage_ids = (pipeline.stage_ids, pipeline.n_stages)
        stages = [
            (sid == 0, sid == pipeline.n_stages - 1, len(part.layers))
            for part, sid in zip(pipeline.parts, pipeline.stage_ids)
        ]
    rows = cfg.parallelism.pipeline_parallel_microbatch_size if pipeline is not None else t.local_batch_size
    job = Job(
        cfg=cfg,
        dims=dims,
        meshes=meshes,
        plan=plan,
        spec=spec,
        args=args,
        converters=converters,
        autocast=builder._autocast,  # (the context the trainer's forward runs in)
        stages=stages,
        rows=rows,
        accumulation=dims.grad_accum_steps(t.local_batch_size, t.global_batch_size) * (t.local_batch_size // rows),
        device_type=device_type,
        moe_imbalance=moe_imbalance,
    )
    params = [_param_plan(clean_fqn(n), p) for n, p in built.model.named_parameters()]
    frozen, trained, trained_models = objective_model_bytes(cfg, builder, built, ModelSource(spec, args))
    return DryRun(
        cfg,
        dims,
        meshes,
        built.model,
        params,
        stages=stage_ids,
        job=job,
        pipeline=pipeline,
        frozen_bytes=frozen,
        trained_bytes=trained,
        engine_bytes=engine_bytes(cfg, spec, args, plan.param_dtype, meshes.tp),
        trained_models=trained_models,
    )


TRAINED_COPIES = 4
"""A trained model's bytes per parameter byte: the parameter, its gradient and AdamW's two moments (its dtype)."""


def objective_model_bytes(
    cfg: JobConfig, builder: ModelBuilder, policy: BuiltModel, start: ModelSource
) -> tuple[int, int, int]:
    """``(frozen, trained, n_trained)``: the bytes on this rank of the parameters of the frozen models the objective
    builds, and of the parameters, gradients and AdamW states of the models it trains beside the policy, each built
    (on meta) by the plan as training builds it: without converters (``ModelHandles.frozen``'s default, and
    ``trainable``); and how many models it trains beside the policy."""
    name = cfg.training.objective
    section = OBJECTIVES.section(name)
    objective = OBJECTIVES.load(name)
    config = getattr(cfg, section.name) if section is not None else None
    wanted = (config, start, start.args.vocab_size, cfg.training.seq_len)
    more = {spec.name: getattr(cfg, spec.name) for spec in OBJECTIVES.more_sections(name)}
    frozen = [s for s in objective.frozen_sources(*wanted, **more) if not is_the_policy(policy, start, (), s)]
    trained = objective.trainable_sources(*wanted, **more)
    return _parameter_bytes(builder, frozen), TRAINED_COPIES * _parameter_bytes(builder, trained), len(trained)


def engine_bytes(cfg: JobConfig, spec: Any, args: Any, training_dtype: torch.dtype, tp_mesh: Any) -> int:
    """The bytes of the rollout engine's copy of the policy (``spec``, ``args``) on this rank, for an objective that
    reads ``[rollout]``: titanium's engine holds the family's plain model in its dtype (``auto``: the training
    forward's, ``training_dtype``), whole or split over ``tp_mesh`` (``tensor_parallel_size`` > 1: this rank's
    part); vLLM's engine manages its own memory (0 here)."""
    wants_engine = any(s.name == "rollout" for s in OBJECTIVES.more_sections(cfg.training.objective))
    if not wants_engine or cfg.rollout.engine != "titanium":
        return 0
    dtype = training_dtype if cfg.rollout.dtype == "auto" else DTYPES[cfg.rollout.dtype]
    with torch.device("meta"):
        model = spec.model_cls(args)
    if cfg.rollout.tensor_parallel_size > 1:
        shard_for_decoding(model, tp_mesh)
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters()) * dtype.itemsize


def _parameter_bytes(builder: ModelBuilder, sources: list[ModelSource]) -> int:
    """The bytes of this rank's parameters of the models of ``sources``, built on meta by ``builder``'s plan."""
    total = 0
    for source in sources:
        model = builder.build(source.spec, source.args, materialize=False).model
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            total += local.numel() * local.element_size()
    return total


def _pop_flag(argv: list[str], name: str, default: str | None = None) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
            del argv[i : i + 2]
            return value
        if arg.startswith(name + "="):
            del argv[i]
            return arg.split("=", 1)[1]
    return default


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    every_block, memory = "--every_block" in argv, "--no_memory" not in argv
    argv = [a for a in argv if a not in ("--every_block", "--no_memory")]
    try:
        world_size = int(_pop_flag(argv, "--world_size", "8"))
        rank = int(_pop_flag(argv, "--rank", "0"))
        device_memory_gib = float(_pop_flag(argv, "--device_memory_gib", "78"))
        device_type = _pop_flag(argv, "--device_type", "cuda")
        moe_imbalance = float(_pop_flag(argv, "--moe_imbalance", "1.25"))
        if not 0 <= rank < world_size:
            raise ConfigError(f"--rank must be in [0, {world_size}), got {rank}")
        if device_type not in ("cuda", "cpu"):
            raise ConfigError(f"--device_type must be cuda or cpu, got {device_type!r}")
        if moe_imbalance < 1:
            raise ConfigError(f"--moe_imbalance must be >= 1 (1: perfectly balanced), got {moe_imbalance}")
        result = dry_run(argv, world_size, rank, device_type, moe_imbalance)
    except (UserError, ValueError) as e:
        print(f"titanium: config error: {e}", file=sys.stderr)
        if dist.is_initialized():
            dist.destroy_process_group()
        return 2
    try:
        for line in result.report(every_block):
            print(line)
        if not memory:
            return 0
        estimate = result.estimate_memory()
        for line in estimate.report(device_memory_gib):
            print(line)
        return 0 if estimate.fits(device_memory_gib) else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
