"""The checks a job passes before any process group exists, and `python -m titanium.preflight`.

``titanium.train`` runs them first; ``run_train.sh`` runs them alone before torchrun starts its
workers, so a bad config costs a second instead of a cluster start-up. Beyond the config's own
validation: the layout against the world size, the model name and flavor, expert parallelism and [moe]
against the flavor, the LoRA targets, the batch sizes, the optimizer-in-backward limits, and the checkpoint
to start from.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from titanium.config import ConfigError, JobConfig
from titanium.config.sections import ModelSection
from titanium.errors import UserError, report
from titanium.inputs import load_job
from titanium.models import build_model_args, get_model_spec, list_models
from titanium.moe_balance import check_bias_reaches_hf, check_moe_config
from titanium.optim.in_backward import check_in_backward
from titanium.parallel.dims import ParallelDims
from titanium.peft.lora import check_lora_config, check_peft_targets


def check_model_name(cfg: ModelSection) -> None:
    """``--model.name`` and ``--model.flavor`` exist in the model registry."""
    if cfg.name not in list_models():
        raise ConfigError(f"--model.name {cfg.name!r} is not a known model; known models: {', '.join(list_models())}")
    flavors = get_model_spec(cfg.name).flavors
    if cfg.flavor not in flavors:
        raise ConfigError(
            f"--model.flavor {cfg.flavor!r} is not a flavor of {cfg.name}; valid flavors: {', '.join(flavors)}"
        )


def check_moe(cfg: JobConfig, dims: ParallelDims) -> None:
    """Expert parallelism and ``[moe]`` against the flavor's architecture (dense or how many experts)."""
    spec = get_model_spec(cfg.model.name)
    args = build_model_args(spec, cfg.model.flavor)
    dims.check_experts(args.decoder_args().moe, model=f"{cfg.model.name} {cfg.model.flavor}")
    export = spec.hf_adapter if cfg.checkpoint.last_save_in_hf else None
    check_moe_config(cfg.moe, args, pipeline=dims.pp > 1, hf_export_adapter=export)
    if args.decoder_args().moe is not None and cfg.training.objective == "grpo" and cfg.rollout.engine == "vllm":
        reader = "--rollout.engine vllm (loaded through that format) could not take the trained weights"
        check_bias_reaches_hf(cfg.moe, spec.hf_adapter, reader=reader, fix="--rollout.engine titanium")


def check_job(cfg: JobConfig, world_size: int) -> ParallelDims:
    """Everything about ``cfg`` that can be checked without a process group; returns the layout."""
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    check_model_name(cfg.model)
    check_moe(cfg, dims)
    check_lora_config(cfg.lora)
    if cfg.lora.rank:
        check_peft_targets(cfg.lora.target_modules, get_model_spec(cfg.model.name).hf_adapter, cfg.model.name)
    dims.grad_accum_steps(cfg.training.local_batch_size, cfg.training.global_batch_size)
    check_in_backward(cfg.optimizer, cfg.training, dp_degree=dims.dp_degree, pp_degree=dims.pp)
    ck = cfg.checkpoint
    if ck.push_to_hub:
        from titanium.checkpoint.hub import check_push  # (the checkpoint package imports DCP: only when pushing)

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
        check_job(load_job(argv), int(os.environ.get("WORLD_SIZE", 1)))
    except UserError as e:
        report(e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
