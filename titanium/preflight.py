"""The checks a job passes before any process group exists, and `python -m titanium.preflight`.

``titanium.train`` runs them first; ``run_train.sh`` runs them alone before torchrun starts its workers, so a bad
config costs a second instead of a cluster start-up. Everything the config decides is checked here
(tests/unit/test_run_time_checks.py lists what is left for run time, and why): the config's own validation; the
layout against the world size; the model's name, and its shape (the Hugging Face start folder's config.json, else
the flavor) against the layout, expert parallelism and [moe]; the model built on the meta device with its pipeline
split and the converters the config turns on (LoRA targets, DoRA with QAT, quantization group sizes and filters,
the PEFT export); the batch sizes; the optimizer-in-backward limits; the checkpoint to start from (and a run that
would evaluate weights it never loaded); and the objective's own checks (``Objective.check_config``: a KD teacher,
PPO's reward and value models, reward functions and reward-model folders, the rollout engine's split and budget).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from titanium.checkpoint.hf import hf_model_args, require_hf_adapter
from titanium.config import ConfigError, JobConfig
from titanium.config.components import OBJECTIVES, check_reads_images
from titanium.errors import UserError, report
from titanium.inputs import load_job
from titanium.model_builder import ModelSource, config_folder, resolve_spec
from titanium.model_setup import StartingWeights, job_converters, job_processor
from titanium.models import build_model_args
from titanium.models.converter import apply_converters
from titanium.models.spec import ModelUse
from titanium.moe_balance import check_bias_reaches_hf, check_moe_config
from titanium.objectives.base import JobFacts
from titanium.optim.in_backward import check_in_backward
from titanium.parallel.dims import ParallelDims
from titanium.parallel.pipeline import check_pipeline
from titanium.peft.export import check_adapter_export
from titanium.peft.lora import check_lora_config, check_peft_targets


def start_model(cfg: JobConfig) -> tuple[ModelSource, str]:
    """The policy as the job starts it, decided as the trainer decides it (``resolve_spec``: a native family or the
    transformers backend), and how to name it: the shape of the Hugging Face config.json it is built from (the start
    folder's, or ``[model] hf_config``; the flavor unused), else the flavor's (with the flavor's vocabulary: the
    tokenizer's replaces it at run time, which changes no check made here)."""
    ck, model, seq_len = cfg.checkpoint, cfg.model, cfg.training.seq_len
    start = ck.initial_load_path if ck.initial_load_in_hf else None
    folder = config_folder(model, start)
    spec, _ = resolve_spec(model, folder)
    require_hf_adapter(spec, ck)
    if folder is not None:
        option = "--checkpoint.initial_load_path" if start is not None else "--model.hf_config"
        args = hf_model_args(spec, folder, option=option, family_option="--model.name", max_seq_len=seq_len)
        return ModelSource(spec, args), f"{spec.name} from {Path(folder) / 'config.json'}"
    if model.flavor not in spec.flavors:
        raise ConfigError(
            f"--model.flavor {model.flavor!r} is not a flavor of {spec.name}; valid flavors: {', '.join(spec.flavors)}"
        )
    return ModelSource(spec, build_model_args(spec, model.flavor, max_seq_len=seq_len)), f"{spec.name} {model.flavor}"


def check_model(cfg: JobConfig, dims: ParallelDims, start: ModelSource, described: str) -> None:
    """Expert parallelism and ``[moe]`` against the model's architecture (dense or how many experts), and what the
    model itself cannot do in this job (``ModelSpec.refusals``: a transformers-backend model's limits)."""
    spec, args = start.spec, start.args
    dims.check_experts(args.decoder_args().moe, model=described)
    export = spec.hf_adapter if cfg.checkpoint.last_save_in_hf else None
    check_moe_config(cfg.moe, args, pipeline=dims.pp > 1, hf_export_adapter=export)
    reads_rollouts = OBJECTIVES.reads(cfg.training.objective, "rollout")
    if args.decoder_args().moe is not None and reads_rollouts and cfg.rollout.engine == "vllm":
        reader = "--rollout.engine vllm (loaded through that format) could not take the trained weights"
        check_bias_reaches_hf(cfg.moe, spec.hf_adapter, reader=reader, fix="--rollout.engine titanium")
    if getattr(args, "reads_images", False):
        check_reads_images(cfg.training.objective)
    if spec.refusals is not None:
        problems = spec.refusals(args, model_use(cfg, dims))
        if problems:
            raise ConfigError(f"{described}: " + "; ".join(problems))


def model_use(cfg: JobConfig, dims: ParallelDims) -> ModelUse:
    """How the job uses its model (``ModelUse``), from its layout and the sections of its objective."""
    objective = cfg.training.objective
    own = OBJECTIVES.section(objective)
    section = getattr(cfg, own.name) if own is not None else None
    rollouts = OBJECTIVES.reads(objective, "rollout") and cfg.rollout.engine == "titanium"
    return ModelUse(
        tensor_parallel=dims.tp,
        pipeline_parallel=dims.pp,
        context_parallel=dims.cp,
        expert_parallel=dims.ep,
        hf_checkpoint=cfg.checkpoint.initial_load_in_hf or cfg.checkpoint.last_save_in_hf,
        packing=f"--{own.name}.packing" if getattr(section, "packing", False) else "",
        shared_prompts=getattr(section, "share_prompt", False),
        compiled_decoding=rollouts and cfg.rollout.compile,
        vllm_rollouts=OBJECTIVES.reads(objective, "rollout") and cfg.rollout.engine == "vllm",
        score_head=OBJECTIVES.needs(objective).score_head,
        split_decoding=cfg.rollout.tensor_parallel_size if rollouts else 1,
        load_balance=cfg.moe.load_balance,
    )


def check_model_build(cfg: JobConfig, dims: ParallelDims, start: ModelSource) -> None:
    """The model built on the meta device (nothing allocated) as the trainer builds it: its pipeline split (stages
    against the schedule, tied embeddings, microbatches) and the converters the config turns on: LoRA's targets
    exist in this model (no ``experts`` in a dense one), DoRA meets no QAT layer, QAT's group size divides the layers
    it quantizes and its filters match layers, and the LoRA adapter the run's end exports (``[lora] save_adapter``)
    is one PEFT loads. The hardware a converter needs is checked where the device is known (run time)."""
    converters = job_converters(cfg, dims, None)
    if not converters and dims.pp == 1:
        return
    ck = cfg.checkpoint
    trained = OBJECTIVES.load(cfg.training.objective).policy_spec(  # (a reward model's scalar head)
        start.spec, None, ck.initial_load_path if ck.initial_load_in_hf else None
    )
    with torch.device("meta"):
        model = trained.model_cls(start.args)
    if dims.pp > 1:
        check_pipeline(model, dims.pp, cfg.parallelism, cfg.training.local_batch_size)
    apply_converters(converters, model)
    if cfg.lora.rank > 0 and cfg.lora.save_adapter and start.spec.hf_adapter is not None:
        check_adapter_export(model, start.spec.hf_adapter, cfg.lora)


def check_objective(cfg: JobConfig, dims: ParallelDims, start: ModelSource, device_type: str) -> None:
    """The objective's own checks (``Objective.check_config``) with its sections and what it may know of the job."""
    name, ck = cfg.training.objective, cfg.checkpoint
    objective = OBJECTIVES.load(name)
    section = OBJECTIVES.section(name)
    more = {spec.name: getattr(cfg, spec.name) for spec in OBJECTIVES.more_sections(name)}
    job = JobFacts(
        start=start,
        seq_len=cfg.training.seq_len,
        local_batch_size=cfg.training.local_batch_size,
        world_size=dims.world_size,
        pipeline_microbatch_size=cfg.parallelism.pipeline_parallel_microbatch_size if dims.pp > 1 else None,
        device_type=device_type,
        start_folder=config_folder(cfg.model, ck.initial_load_path if ck.initial_load_in_hf else None),
    )
    objective.check_config(getattr(cfg, section.name) if section is not None else None, job, **more)


def check_job(
    cfg: JobConfig, world_size: int, device_type: str | None = None, *, processor: bool = True
) -> ParallelDims:
    """Everything about ``cfg`` that can be checked without a process group; returns the layout. ``device_type``:
    where the job computes (None: as init_distributed picks it on this machine, cuda where torch sees a GPU).
    ``processor``: load an image-text model's processor from its folder (the dry run, which reads published configs
    alone and never its rows' images, leaves it out)."""
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    ck = cfg.checkpoint
    start, described = start_model(cfg)
    dims.check_model(start.args.decoder_args(), model=described, seq_len=cfg.training.seq_len)
    check_model(cfg, dims, start, described)
    if processor:
        job_processor(cfg, start.args)  # (None for a text model)
    check_lora_config(cfg.lora)
    if cfg.lora.rank:
        check_peft_targets(cfg.lora.target_modules, start.spec.hf_adapter, start.spec.name)
    check_model_build(cfg, dims, start)
    dims.grad_accum_steps(cfg.training.local_batch_size, cfg.training.global_batch_size)
    check_in_backward(cfg.optimizer, cfg.training, dp_degree=dims.dp_degree, pp_degree=dims.pp)
    if ck.push_to_hub:
        from titanium.checkpoint.hub import check_push  # (the checkpoint package imports DCP: only when pushing)

        check_push(ck.push_to_hub, "--checkpoint.push_to_hub")
    if ck.initial_load_path and not ck.initial_load_in_hf:
        from titanium.checkpoint.manager import check_checkpoint  # (imports DCP: only when there is one to check)

        check_checkpoint(Path(ck.initial_load_path), "--checkpoint.initial_load_path")
    if cfg.training.steps == 0:
        StartingWeights(ck, cfg.job.dump_folder).check_evaluate_only(cfg.training)
    check_objective(cfg, dims, start, device_type or ("cuda" if torch.cuda.is_available() else "cpu"))
    return dims


def main(argv: list[str] | None = None) -> int:
    """Check a job given as titanium.train's arguments (WORLD_SIZE: the process count); exit 2 on a problem."""
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        return 0  # titanium.train prints the help
    try:
        check_job(load_job(argv), int(os.environ.get("WORLD_SIZE", 1)))
    except UserError as e:
        report(e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
