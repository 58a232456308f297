"""The checks a job passes before any process group exists, and `python -m titanium.preflight`.

``titanium.train`` runs them first; ``run_train.sh`` runs them alone before torchrun starts its
workers, so a bad config costs a second instead of a cluster start-up. Beyond the config's own
validation: the layout against the world size, the model (its family or backend, flavor or config.json) and
what it cannot do in this job, expert parallelism and [moe] against its architecture, the LoRA targets, the
batch sizes, the optimizer-in-backward limits, and the checkpoint to start from.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from titanium.checkpoint.hf import hf_model_args
from titanium.checkpoint.hub import check_push
from titanium.config import ConfigError, JobConfig, load_config
from titanium.errors import UserError, report
from titanium.model_builder import config_folder, resolve_spec
from titanium.models import build_model_args
from titanium.models.spec import ModelUse
from titanium.moe_balance import check_bias_reaches_hf, check_moe_config
from titanium.optim.in_backward import check_in_backward
from titanium.parallel.dims import ParallelDims
from titanium.peft.lora import check_lora_config


def check_model(cfg: JobConfig, dims: ParallelDims) -> None:
    """The model the job builds, decided as the trainer decides it (``resolve_spec``: a native family or the
    transformers backend, from the Hugging Face config.json where there is one): its flavor or config.json, expert
    parallelism and [moe] against its architecture, and what the model itself cannot do in this job
    (``ModelSpec.refusals``)."""
    start = cfg.checkpoint.initial_load_path if cfg.checkpoint.initial_load_in_hf else None
    folder = config_folder(cfg.model, start)
    spec, _ = resolve_spec(cfg.model, folder)
    if folder is not None:
        args = hf_model_args(spec, folder)
        described = f"{spec.name} from {folder}"
    else:
        if cfg.model.flavor not in spec.flavors:
            raise ConfigError(
                f"--model.flavor {cfg.model.flavor!r} is not a flavor of {spec.name}; valid flavors: "
                f"{', '.join(spec.flavors)}"
            )
        args = build_model_args(spec, cfg.model.flavor)
        described = f"{spec.name} {cfg.model.flavor}"
    dims.check_experts(args.decoder_args().moe, model=described)
    export = spec.hf_adapter if cfg.checkpoint.last_save_in_hf else None
    check_moe_config(cfg.moe, args, pipeline=dims.pp > 1, hf_export_adapter=export)
    if args.decoder_args().moe is not None and cfg.training.objective == "grpo" and cfg.rollout.engine == "vllm":
        reader = "--rollout.engine vllm (loaded through that format) could not take the trained weights"
        check_bias_reaches_hf(cfg.moe, spec.hf_adapter, reader=reader, fix="--rollout.engine titanium")
    if spec.refusals is not None:
        problems = spec.refusals(args, model_use(cfg, dims))
        if problems:
            raise ConfigError(f"{described}: " + "; ".join(problems))


def model_use(cfg: JobConfig, dims: ParallelDims) -> ModelUse:
    """How the job uses its model (``ModelUse``), from its layout and the sections of its objective."""
    objective = cfg.training.objective
    packing = {"sft": "--sft.packing", "dpo": "--dpo.packing", "kto": "--kto.packing"}.get(objective, "")
    section = getattr(cfg, objective, None)
    rollouts = objective in ("grpo", "ppo") and cfg.rollout.engine == "titanium"
    return ModelUse(
        tensor_parallel=dims.tp,
        pipeline_parallel=dims.pp,
        context_parallel=dims.cp,
        expert_parallel=dims.ep,
        hf_checkpoint=cfg.checkpoint.initial_load_in_hf or cfg.checkpoint.last_save_in_hf,
        packing=packing if getattr(section, "packing", False) else "",
        shared_prompts=objective == "dpo" and cfg.dpo.share_prompt,
        kv_cache_decoding=rollouts or cfg.eval.interval > 0,
        score_head=objective in ("reward", "ppo"),
        split_decoding=cfg.rollout.tensor_parallel_size if rollouts else 1,
        load_balance=cfg.moe.load_balance,
    )


def check_job(cfg: JobConfig, world_size: int) -> ParallelDims:
    """Everything about ``cfg`` that can be checked without a process group; returns the layout."""
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    check_model(cfg, dims)
    check_lora_config(cfg.lora)
    dims.grad_accum_steps(cfg.training.local_batch_size, cfg.training.global_batch_size)
    check_in_backward(cfg.optimizer, cfg.training, dp_degree=dims.dp_degree, pp_degree=dims.pp)
    ck = cfg.checkpoint
    if ck.push_to_hub:
        check_push(ck.push_to_hub, "--checkpoint.push_to_hub")
    if ck.initial_load_path and not ck.initial_load_in_hf:
        from titanium.checkpoint.manager import check_checkpoint  # (imports DCP: only when there is one to check)

        check_checkpoint(Path(ck.initial_load_path), "--checkpoint.initial_load_path")
    return dims


def main(argv: list[str] | None = None) -> int:
    """Check a job given as titanium.train's arguments (WORLD_SIZE: the process count); exit 2 on a problem."""
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        return 0  # titanium.train prints the help
    try:
        check_job(load_config(argv), int(os.environ.get("WORLD_SIZE", 1)))
    except UserError as e:
        report(e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
