"""Convert model weights between a titanium DCP checkpoint and the Hugging Face format, offline.

    # a training checkpoint -> an HF folder that transformers / vLLM / lm-eval load
    python -m titanium.tools.convert to-hf outputs/run/checkpoint/step-1000 out/hf --model qwen3 \\
        --source /path/Qwen3-0.6B --dtype bfloat16
    # an HF folder -> a model-only DCP checkpoint (step-0, a seed checkpoint any layout resumes from)
    python -m titanium.tools.convert from-hf /path/Qwen3-0.6B outputs/run/checkpoint --model qwen3
    # an HF folder -> a quantized HF folder for serving (torchao; transformers loads it as is)
    python -m titanium.tools.convert quantize out/hf out/hf-int8 --model qwen3 --scheme int8_weight_only

With ``--source`` (the HF folder the run started from) the output has the source's keys, files,
index, config.json and tokenizer files; without it, ``--flavor`` gives the architecture and the
files are cut at ``--max-shard-size``. One process, CPU (quantize: the GPU for CUDA-only schemes),
no process group; only the model weights of a checkpoint are read, and nothing is unpickled. Bad
input is one message and exit code 2.
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

from titanium.checkpoint.hf import EXPORT_DTYPES, HFCheckpoint, hf_model_args, save_hf_weights, shard_size_bytes
from titanium.errors import UserError
from titanium.model_builder import ModelBuilder
from titanium.models import get_model_spec, list_models
from titanium.peft.lora import is_lora_param
from titanium.quantize.schemes import SCHEMES
from titanium.quantize.serving import export_quantized_hf

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
) -> Path:
    spec = get_model_spec(model)
    if spec.hf_adapter is None:
        raise UserError(f"model {model!r} has no Hugging Face adapter")
    shapes = _checkpoint_shapes(checkpoint)
    if any(is_lora_param(name) for name in shapes):
        raise UserError(
            f"{checkpoint} is a LoRA run's checkpoint: it holds the adapters only, not a whole model "
            f"({sum(map(is_lora_param, shapes))} adapter tensors), so there is nothing to convert to a Hugging Face "
            "folder on its own, and converting one (merged with its base, or as a PEFT adapter) is not supported yet. "
            "A LoRA run writes its adapter in PEFT layout at its end ([lora] save_adapter, in [lora] "
            "adapter_folder) and the merged model with --checkpoint.last_save_in_hf"
        )
    if source is not None:
        args = hf_model_args(spec, source)
    elif flavor is not None:
        if flavor not in spec.flavors:
            raise UserError(f"unknown flavor {flavor!r} for {model}; valid: {', '.join(spec.flavors)}")
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
    wrong = [f"{k} {list(shapes[k])} != {list(v.shape)}" for k, v in wanted.items() if tuple(v.shape) != shapes[k]]
    if missing or wrong:
        raise UserError(
            f"{checkpoint} does not hold a {model} model of this architecture: "
            + "; ".join(filter(None, [f"missing {', '.join(missing[:8])}" if missing else "", *wrong[:8]]))
        )
    dcp.load({MODEL_KEY: wanted}, checkpoint_id=str(checkpoint), no_dist=True)
    if args.tie_word_embeddings:
        state[spec.hf_adapter.output_key] = state[spec.hf_adapter.embedding_key]
    ckpt = HFCheckpoint.open(source) if source is not None else None
    return save_hf_weights(
        state,
        out,
        spec.hf_adapter,
        args,
        dtype=EXPORT_DTYPES[dtype],
        source=ckpt,
        max_shard_bytes=shard_size_bytes(max_shard_size),
    )


def hf_to_dcp(folder: Path, out: Path, model: str) -> Path:
    """Write the HF folder's weights as ``out/step-0`` (model only): a seed checkpoint for titanium."""
    net = ModelBuilder(torch.device("cpu")).load_hf(get_model_spec(model), folder).model
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
    to_hf.add_argument("--dtype", default="bfloat16", choices=sorted(EXPORT_DTYPES))
    to_hf.add_argument("--max-shard-size", default="5GB", help="file size cap without --source (default 5GB)")
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
    try:
        if args.command == "to-hf":
            path = dcp_to_hf(
                args.checkpoint,
                args.out,
                args.model,
                flavor=args.flavor,
                source=args.source,
                dtype=args.dtype,
                max_shard_size=args.max_shard_size,
            )
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
    except UserError as e:
        print(f"titanium.tools.convert: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
