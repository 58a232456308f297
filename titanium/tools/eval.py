"""Run lm-evaluation-harness tasks on a titanium checkpoint or a Hugging Face folder, through titanium's own model.

    python -m titanium.tools.eval outputs/debug_sft/checkpoint/step-200 --tasks arithmetic_mc,arithmetic_gen \\
        --include_path assets/tasks/arithmetic/lm_eval --apply_chat_template
    python -m titanium.tools.eval /data/Qwen3-0.6B --tasks hellaswag,gsm8k --batch_size 16 --output_path results/
    torchrun --nproc_per_node 8 -m titanium.tools.eval /data/Llama-3.1-70B --tasks mmlu --batch_size 8

MODEL is a titanium checkpoint folder (step-N, read with the config.toml its run wrote two folders up, or --config:
the family, tokenizer, chat template and any LoRA adapters, run without merging) or a Hugging Face folder
(config.json, *.safetensors, tokenizer.json). The lm_eval flags keep their names (--tasks, --num_fewshot, --limit,
--batch_size, --output_path, --log_samples, --apply_chat_template, --include_path, ...). Further --section.key
value pairs adjust the job config as for training, e.g. --training.mixed_precision_param float32, or for a Hugging
Face folder --tokenizer.path and --chat.chat_template.

Under torchrun the model is sharded with FSDP over the processes (models one device cannot hold) and each process
evaluates its share of the requests; the results are printed (and written) once. Needs the optional dependency
lm-eval (pip install -e '.[eval]'). Bad input (an unknown task, a task whose data must be downloaded while offline,
a checkpoint without its config) is one message and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from titanium.errors import UserError, report
from titanium.evaluation.harness import TaskRun, require_lm_eval, run_tasks, task_manager

CONFIG_FILE = "config.toml"


def _list(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m titanium.tools.eval",
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", type=Path, help="a titanium checkpoint (step-N) or a Hugging Face folder")
    p.add_argument("--tasks", type=_list, required=True, help="comma-separated lm-eval task or group names")
    p.add_argument("--num_fewshot", type=int, help="few-shot examples per prompt (default: each task's own)")
    p.add_argument("--limit", type=float, help="first N documents per task (a fraction < 1: that share)")
    p.add_argument("--batch_size", type=int, default=1, help="requests per forward on each process (default 1)")
    p.add_argument("--max_gen_toks", type=int, default=256, help="new tokens where a task does not say (256)")
    p.add_argument("--output_path", help="folder (or .json file) for the results, and the samples with --log_samples")
    p.add_argument("--log_samples", action="store_true", help="also write every prompt, answer and score")
    p.add_argument("--include_path", help="a folder of your own task YAMLs")
    p.add_argument(
        "--apply_chat_template", action="store_true", help="render prompts with the model's chat template (instruct)"
    )
    p.add_argument(
        "--fewshot_as_multiturn",
        type=lambda x: x.lower() in ("true", "1", "yes"),
        help="few-shot examples as chat turns (default: with --apply_chat_template)",
    )
    p.add_argument("--system_instruction", help="a system message before every prompt")
    p.add_argument("--gen_kwargs", help="generation arguments for every task, e.g. temperature=0.7,do_sample=True")
    p.add_argument("--bootstrap_iters", type=int, default=100000, help="for standard errors (0: none)")
    p.add_argument("--seed", type=int, default=0, help="seed of lm-eval's few-shot sampling and of sampling")
    p.add_argument("--config", type=Path, help=f"a titanium checkpoint's run config (default: its run's {CONFIG_FILE})")
    return p


def job_config(model: Path, config: Path | None, overrides: list[str]) -> tuple[Any, str]:
    """The job config MODEL is read with, and what MODEL is ("dcp" or "hf")."""
    from titanium.config import load_config

    if (model / ".metadata").is_file():
        path = config if config is not None else model.resolve().parent.parent / CONFIG_FILE
        if not path.is_file():
            raise UserError(
                f"{model} is a titanium checkpoint: its model family, shape and tokenizer come from the config its run "
                f"wrote, which is not at {path}; pass --config (the run's job.dump_folder/{CONFIG_FILE})"
            )
        return load_config(["--job.config_file", str(path), *overrides]), "dcp"
    if (model / "config.json").is_file():
        # (--model.name auto: build_model resolves the family, or the transformers backend, from config.json)
        tokenizer = [] if any(f.startswith("--tokenizer.") for f in overrides) else _hf_tokenizer(model)
        return load_config([*tokenizer, *overrides]), "hf"
    raise UserError(
        f"{model}: neither a titanium checkpoint (a step-N folder with .metadata) nor a Hugging Face folder "
        "(config.json and *.safetensors)"
    )


def _hf_tokenizer(folder: Path) -> list[str]:
    if not (folder / "tokenizer.json").is_file():
        raise UserError(f"{folder} has no tokenizer.json: pass --tokenizer.kind and --tokenizer.path")
    return ["--tokenizer.kind", "hf", "--tokenizer.path", str(folder / "tokenizer.json")]


def check_layout(dims: Any) -> None:
    """Only data-parallel layouts: each rank evaluates its own requests, the model whole or sharded by FSDP."""
    if dims.tp > 1 or dims.pp > 1 or dims.cp > 1:
        raise UserError(
            "titanium.tools.eval shards the model with FSDP only: set --parallelism.tensor_parallel_degree, "
            "--parallelism.pipeline_parallel_degree and --parallelism.context_parallel_degree to 1"
        )


def build_model(cfg: Any, kind: str, model: Path, dims: Any) -> tuple[Any, Any, Any, Any]:
    """(the built model in eval mode, its tokenizer, the process environment, the data-parallel group or None) under
    the job's FSDP plan."""
    from titanium.config.sections import CompileSection
    from titanium.data.tokenizer import build_tokenizer
    from titanium.model_builder import ModelBuilder, WeightSource, resolve_spec
    from titanium.model_setup import job_plan
    from titanium.parallel.distributed import init_distributed
    from titanium.tools.lora_checkpoint import build_checkpoint_model

    env = init_distributed(cfg.comm)
    meshes = dims.build_meshes(env.device.type)
    plan = job_plan(cfg, dims, env.device.type, compile=CompileSection(), announce=env.rank == 0)
    builder = ModelBuilder(env.device, cfg.debug.seed, dims, meshes, plan, attention=cfg.model.attention)
    tokenizer = build_tokenizer(cfg.tokenizer)
    if kind == "dcp":
        built = build_checkpoint_model(model, cfg, builder, dims)
    else:
        from titanium.checkpoint.hf import hf_model_args

        spec, _ = resolve_spec(cfg.model, model)  # (the family, or the transformers backend)
        args = hf_model_args(spec, model, tokenizer_vocab=tokenizer.vocab_size)
        built = builder.build(spec, args, weights=WeightSource(hf_folder=str(model)))
    built.model.eval()
    return built, tokenizer, env, meshes.dp.get_group() if dims.dp_degree > 1 else None


def evaluate(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any] | None:
    """Load MODEL, run the tasks; the results dict on rank 0 (None elsewhere)."""
    require_lm_eval()
    from titanium.parallel.dims import ParallelDims

    cfg, kind = job_config(args.model, args.config, overrides)
    dims = ParallelDims.from_config(cfg.parallelism, int(os.environ.get("WORLD_SIZE", 1)))
    check_layout(dims)
    if args.batch_size < 1 or args.max_gen_toks < 1:
        raise UserError("--batch_size and --max_gen_toks must be >= 1")
    manager = task_manager(args.tasks, args.include_path)  # (unknown tasks found before any process group)

    from titanium.data.chat import build_chat_template
    from titanium.evaluation.lm import TitaniumLM

    built, tokenizer, env, dp_group = build_model(cfg, kind, args.model, dims)
    template = (
        build_chat_template(cfg.chat.chat_template, tokenizer, built.spec.chat_template or "")
        if args.apply_chat_template
        else None
    )
    lm = TitaniumLM(
        built.model,
        tokenizer,
        max_length=built.model.args.max_seq_len,
        batch_size=args.batch_size,
        max_gen_toks=args.max_gen_toks,
        template=template,
        device=env.device,
        group=dp_group,
        forward_context=built.autocast,
        name=str(args.model),
    )
    tracker = None
    if args.output_path:
        from lm_eval.loggers import EvaluationTracker

        tracker = EvaluationTracker(output_path=args.output_path)
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    run = TaskRun(
        tasks=args.tasks,
        limit=limit,
        num_fewshot=args.num_fewshot,
        apply_chat_template=args.apply_chat_template,
        fewshot_as_multiturn=args.fewshot_as_multiturn,
        system_instruction=args.system_instruction,
        gen_kwargs=args.gen_kwargs,
        log_samples=args.log_samples,
        bootstrap_iters=args.bootstrap_iters,
        seed=args.seed,
    )
    results = run_tasks(lm, run, manager, tracker)
    if results is not None and tracker is not None:
        samples = results.pop("samples", None)
        tracker.save_results_aggregated(results=results, samples=samples)
        for task in results["configs"] if samples else ():
            tracker.save_results_samples(task_name=task, samples=samples[task])
    return results


def main(argv: list[str] | None = None) -> int:
    args, overrides = parser().parse_known_args(argv)
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.WARNING, format=f"[rank{rank}] %(message)s")
    logging.getLogger("titanium").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    try:
        results = evaluate(args, overrides)
    except UserError as e:
        report(e)
        return 2
    finally:
        from titanium.parallel.distributed import shutdown_distributed

        shutdown_distributed()
    if results is not None:
        from lm_eval.utils import make_table

        print(make_table(results))
        if "groups" in results:
            print(make_table(results, "groups"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
