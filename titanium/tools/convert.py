"""Convert model weights between a titanium DCP checkpoint and the Hugging Face format, offline.

    # a training checkpoint -> an HF folder that transformers / vLLM / lm-eval load
    python -m titanium.tools.convert to-hf outputs/run/checkpoint/step-1000 out/hf --model qwen3 \\
        --source /path/Qwen3-0.6B --dtype bfloat16
    # a LoRA run's checkpoint -> its adapter in PEFT layout (peft.PeftModel.from_pretrained loads it)
    python -m titanium.tools.convert to-peft outputs/lora_run/checkpoint/step-1000 out/adapter
    # an HF folder -> a model-only DCP checkpoint (step-0, a seed checkpoint any layout resumes from)
    python -m titanium.tools.convert from-hf /path/Qwen3-0.6B outputs/run/checkpoint --model qwen3
    # an HF folder -> a quantized HF folder for serving (torchao; transformers loads it as is)
    python -m titanium.tools.convert quantize out/hf out/hf-int8 --model qwen3 --scheme int8_weight_only

With ``--source`` (the HF folder the run started from) the output has the source's keys, files,
index, config.json and tokenizer files; without it, ``--flavor`` gives the architecture and the
files are cut at ``--max-shard-size``.

A LoRA run's checkpoint holds only its adapters: the base model and the [lora] settings come from
the run's config.toml (beside its checkpoint folder, or ``--config``); ``to-hf`` writes the merged
model as ``--checkpoint.last_save_in_hf`` would have at that step, ``to-peft`` the adapter as the
run's end writes it. ``--push-to-hub user/repo`` then uploads the folder written (token from
``HF_TOKEN`` or ``hf auth login``; a repository that does not exist is created private).

One process, CPU (quantize: the GPU for CUDA-only schemes), no process group; only the model
weights of a checkpoint are read, and nothing is unpickled. Bad input is one message and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from titanium.checkpoint.hf import (
    EXPORT_DTYPES,
    HFCheckpoint,
    export_final_hf,
    hf_model_args,
    save_hf_weights,
    shard_size_bytes,
)
from titanium.checkpoint.hub import check_push, upload
from titanium.checkpoint.quantized_export import export_quantized_hf
from titanium.config.sections import CheckpointSection
from titanium.data.export import save_tokenizer
from titanium.errors import UserError
from titanium.model_builder import ModelBuilder
from titanium.models import get_model_spec, list_models
from titanium.peft.export import export_peft_adapter
from titanium.peft.lora import is_lora_param
from titanium.quantize.schemes import SCHEMES
from titanium.tools.lora_checkpoint import load_lora_run

MODEL_KEY = "model"
"""Top-level key of the model weights in titanium's DCP checkpoints (``model.<parameter name>``)."""


def _checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the model weights stored in a DCP checkpoint folder."""
    if not (path / ".metadata").is_file():
        raise UserError(f"{path} is not a complete DCP checkpoint (no .metadata); pass a step-N folder")
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    prefix = MODEL_KEY + "."
    shapes = {
        k[len(prefix) :]: tuple(v.size) for k, v in metadata.items() if k.startswith(prefix) and hasattr(v, "size")
    }
    if not shapes:
        raise UserError(f"{path} holds no model weights (no '{prefix}*' entries)")
    return shapes


def dcp_to_hf(
    checkpoint: Path,
    out: Path,
    model: str,
    *,
    flavor: str | None,
    source: Path | None,
    dtype: str,
    max_shard_size: str,
    config: Path | None = None,
) -> Path:
    """A titanium checkpoint's model as a Hugging Face folder (a LoRA run's: merged with its base)."""
    spec = get_model_spec(model)
    if spec.hf_adapter is None:
        raise UserError(f"model {model!r} has no Hugging Face adapter")
    shapes = _checkpoint_shapes(checkpoint)
    if any(is_lora_param(name) for name in shapes):
        if flavor is not None or source is not None:
            raise UserError(
                f"{checkpoint} is a LoRA run's checkpoint: its architecture and base come from the run's config "
                "(--config); drop --flavor and --source"
            )
        return lora_to_hf(checkpoint, out, model, config=config, dtype=dtype)
    if source is not None:
        args = hf_model_args(spec, source, option="--source", family_option="--model")
    elif flavor is not None:
        if flavor not in spec.flavors:
            raise UserError(f"--flavor {flavor!r} is not a flavor of {model}; valid: {', '.join(spec.flavors)}")
        vocab = shapes.get(spec.hf_adapter.embedding_key, (spec.flavors[flavor].vocab_size,))[0]
        args = dataclasses.replace(spec.flavors[flavor], vocab_size=vocab)
    else:
        raise UserError("pass --source (the HF folder the run started from) or --flavor")
    # Built on meta by the one builder, then filled from the checkpoint (no initialization to throw away).
    net = ModelBuilder(torch.device("cpu")).build(spec, args, materialize=False).model
    net.to_empty(device="cpu")
    state = net.state_dict()
    wanted = {k: v for k, v in state.items() if k in shapes}
    missing = sorted(set(state) - set(shapes) - ({spec.hf_adapter.output_key} if args.tie_word_embeddings else set()))
    unexpected = sorted(set(shapes) - set(state))  # (dropped silently otherwise)
    wrong = [f"{k} {list(shapes[k])} != {list(v.shape)}" for k, v in wanted.items() if tuple(v.shape) != shapes[k]]
    if missing or unexpected or wrong:
        problems = [f"missing {', '.join(missing[:8])}" if missing else "", *wrong[:8]]
        problems.append(f"tensors the model has no place for: {', '.join(unexpected[:8])}" if unexpected else "")
        raise UserError(
            f"CHECKPOINT {checkpoint} does not hold a {model} model of this architecture: "
            + "; ".join(filter(None, problems))
            + " (check --model and --flavor or --source)"
        )
    dcp.load({MODEL_KEY: wanted}, checkpoint_id=str(checkpoint), no_dist=True)
    if args.tie_word_embeddings:
        state[spec.hf_adapter.output_key] = state[spec.hf_adapter.embedding_key]
    ckpt = HFCheckpoint.open(source, "--source") if source is not None else None
    return save_hf_weights(
        state,
        out,
        spec.hf_adapter,
        args,
        dtype=EXPORT_DTYPES[dtype],
        source=ckpt,
        max_shard_bytes=shard_size_bytes(max_shard_size),
    )


EXPORT_DTYPE = CheckpointSection().export_dtype
"""One default for every Hugging Face export, a run's and this tool's."""


def lora_to_hf(checkpoint: Path, out: Path, model: str, *, config: Path | None, dtype: str) -> Path:
    """A LoRA run's checkpoint merged with the run's base: the run's own ``last_save_in_hf`` export, at that step."""
    run = load_lora_run(checkpoint, config)
    if run.built.spec.name != model:  # (the family the run resolved, --model.name auto included)
        raise UserError(f"--model {model}: the run that wrote {checkpoint} trained a {run.built.spec.name} model")
    export = dataclasses.replace(run.cfg.checkpoint, hf_folder=str(out.resolve()), export_dtype=dtype)
    path = export_final_hf(
        run.built.model,
        run.built.spec,
        run.built.args,
        export,
        dump_folder=run.cfg.job.dump_folder,
        flavor=run.cfg.model.flavor,
    )
    assert path is not None  # (one process: rank 0)
    save_tokenizer(path, run.tokenizer, run.cfg.chat.chat_template, run.built.spec.chat_template or "")
    return path


def lora_to_peft(checkpoint: Path, out: Path, *, config: Path | None) -> Path:
    """A LoRA run's checkpoint as a PEFT adapter folder, as the run's end-of-training adapter export writes it."""
    if not any(is_lora_param(name) for name in _checkpoint_shapes(checkpoint)):
        raise UserError(f"{checkpoint} holds no LoRA adapters (not a LoRA run's checkpoint); use to-hf")
    run = load_lora_run(checkpoint, config)
    adapter = run.built.spec.hf_adapter
    if adapter is None:
        raise UserError(f"model {run.built.spec.name!r} has no Hugging Face adapter")
    path = export_peft_adapter(run.built.model, adapter, run.built.args, run.cfg.lora, out, run.base_model_name_or_path)
    assert path is not None  # (one process: rank 0)
    save_tokenizer(path, run.tokenizer, run.cfg.chat.chat_template, run.built.spec.chat_template or "")
    return path


def hf_to_dcp(folder: Path, out: Path, model: str) -> Path:
    """Write the HF folder's weights as ``out/step-0`` (model only): a seed checkpoint for titanium."""
    builder = ModelBuilder(torch.device("cpu"))
    net = builder.load_hf(get_model_spec(model), folder, option="FOLDER", family_option="--model").model
    target = out / "step-0"
    if target.exists():
        raise UserError(f"{target} exists; refusing to overwrite it")
    partial = out / ".step-0.partial"
    dcp.save({MODEL_KEY: net.state_dict()}, checkpoint_id=str(partial), no_dist=True)
    partial.rename(target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m titanium.tools.convert",
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    to_hf = sub.add_parser("to-hf", help="DCP checkpoint folder (step-N) -> Hugging Face folder")
    to_hf.add_argument("checkpoint", type=Path, help="a titanium checkpoint folder, e.g. outputs/x/checkpoint/step-100")
    to_hf.add_argument("out", type=Path, help="output folder (replaced if it exists)")
    to_hf.add_argument("--model", required=True, choices=list_models())
    to_hf.add_argument("--flavor", help="architecture preset (when there is no --source)")
    to_hf.add_argument("--source", type=Path, help="HF folder the run started from: reuse its layout and files")
    to_hf.add_argument(
        "--dtype",
        default=EXPORT_DTYPE,
        choices=sorted(EXPORT_DTYPES),
        help=f"dtype of the weights written (default {EXPORT_DTYPE}, as a run's [checkpoint] export_dtype)",
    )
    to_hf.add_argument("--max-shard-size", default="5GB", help="file size cap without --source (default 5GB)")
    to_peft = sub.add_parser("to-peft", help="a LoRA run's DCP checkpoint (step-N) -> PEFT adapter folder")
    to_peft.add_argument("checkpoint", type=Path, help="a LoRA run's checkpoint, e.g. outputs/x/checkpoint/step-100")
    to_peft.add_argument("out", type=Path, help="output folder (replaced if it exists)")
    for command in (to_hf, to_peft):
        command.add_argument(
            "--config",
            type=Path,
            help="LoRA checkpoints: the run's config.toml (default: two folders above the checkpoint, where the run "
            "wrote it)",
        )
        command.add_argument("--push-to-hub", metavar="REPO", help="then upload the folder to this hub repository")
    from_hf = sub.add_parser("from-hf", help="Hugging Face folder -> model-only DCP checkpoint OUT/step-0")
    from_hf.add_argument("folder", type=Path, help="HF folder with config.json and *.safetensors")
    from_hf.add_argument("out", type=Path, help="checkpoint folder to create step-0 in")
    from_hf.add_argument("--model", required=True, choices=list_models())
    quantize = sub.add_parser(
        "quantize",
        help="Hugging Face folder -> quantized Hugging Face folder for serving (torchao)",
        description="Schemes:\n" + "\n".join(f"  {name}: {s.summary}" for name, s in SCHEMES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    quantize.add_argument("folder", type=Path, help="HF folder with config.json and *.safetensors (e.g. from to-hf)")
    quantize.add_argument("out", type=Path, help="output folder (replaced if it exists)")
    quantize.add_argument("--model", required=True, choices=list_models())
    quantize.add_argument("--scheme", required=True, choices=list(SCHEMES))
    quantize.add_argument(
        "--group-size", type=int, default=32, help="inputs per weight scale, int4 schemes (default 32, as [qat])"
    )
    quantize.add_argument(
        "--filter-fqns",
        nargs="*",
        default=["output"],
        help="linear layers whose titanium name contains one of these stay unquantized (default: output)",
    )
    quantize.add_argument("--dtype", default="bfloat16", choices=sorted(EXPORT_DTYPES), help="(default bfloat16)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process on purpose
    push = getattr(args, "push_to_hub", None)
    try:
        if push is not None:
            check_push(push, "--push-to-hub")
        if args.command == "to-hf":
            path = dcp_to_hf(
                args.checkpoint,
                args.out,
                args.model,
                flavor=args.flavor,
                source=args.source,
                dtype=args.dtype,
                max_shard_size=args.max_shard_size,
                config=args.config,
            )
        elif args.command == "to-peft":
            path = lora_to_peft(args.checkpoint, args.out, config=args.config)
        elif args.command == "from-hf":
            path = hf_to_dcp(args.folder, args.out, args.model)
        else:
            path = export_quantized_hf(
                args.folder,
                args.out,
                args.model,
                args.scheme,
                group_size=args.group_size,
                filter_fqns=args.filter_fqns,
                dtype=EXPORT_DTYPES[args.dtype],
            )
        print(f"wrote {path}")
        if push is not None:
            print(f"uploaded to {upload(path, push)}")
    except UserError as e:
        print(f"titanium.tools.convert: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
