"""Pretraining speed on one GPU: eager -> compile -> compile + Float8 (tensorwise, rowwise), beside the papers.

Models, both at sequence length 8192 on synthetic tokens, bf16 (autocast: one GPU has no FSDP), per-op selective
activation checkpointing, fused AdamW at lr 3e-4 after 2 warmup steps (the Llama 3 configs' peak lr: the debug
config's 3e-3 made the 8B-shaped loss climb from 12.2 to 13-16 with gradient norms up to 6e4 within 10 steps on an
H200; speed does not depend on it, but the numbers should come from a sane run), the trainer's own tokens/s per
device, MFU and peak memory (means of the logged windows after step 1, so compilation is left out):

- Llama 3 8B-shaped: every dimension of Llama 3.1 8B (dim 4096, 32 heads, 8 KV heads, FFN 14336, vocabulary
  128,256) but ``--layers-8b`` blocks instead of 32, so that weights, gradients and AdamW state fit one 80 GB
  GPU (the dry run estimates 70 GiB for 8 blocks); local batch 2 (the paper's). The table also gives its tokens/s
  at full depth: scaled to the 32 blocks of the real 8B by FLOPs per token (x 6N+attention of the cut model / that
  of 8B, i.e. at the same MFU), the number comparable to the papers' rows.
- Llama 3.2 1B (16 blocks, tied embeddings), local batch 2 (train_configs/llama3_1b.toml's 4 is for 8 GPUs with
  FSDP; on one, the dry run estimates 91 GiB at 4 and 53 GiB at 2); no paper row.
- Qwen3-30B-A3B-shaped (``--models 30B-A3B``): every dimension of Qwen3-30B-A3B (dim 2048, 32 heads, 4 KV heads,
  128 experts of width 768, top-8, vocabulary 151,936) but ``--layers-moe`` of its 48 blocks, local batch 2 (the
  dry run, with its 1.25 routing-imbalance margin, estimates 61 GiB for 3 blocks, 69 GiB for 4, 52 GiB for 4 at
  batch 1). Experts run through ``torch._grouped_mm`` in bf16. MFU counts the parameters a token computes with
  (8 of 128 experts); no paper row.

The vocabulary is a generated tokenizer file of the model's size (no hub download; the data is random tokens).
The reference rows are the papers' measured numbers, quoted with their table:
- torchtitan paper, Table 1: Llama 3.1 8B, 8 H100s, FSDP, selective AC, local batch 2, seq 8192 (Float8 with
  its default recipe, tensorwise). Ratio = our tokens/s at full depth over theirs; theirs pays for FSDP's
  communication over 8 GPUs, ours for none.
- TorchAO paper, Table 3: Llama3-8B, 8 H100s, batch 1, seq 8192, compile, selective AC (tensorwise with a
  Float8 all-gather, which one GPU has no use for; rowwise with a bf16 all-gather).

    python benchmarks/pretrain_speed.py --models 8B --out benchmarks/results/pretrain_8b_h100.md  # one GPU
    python benchmarks/pretrain_speed.py --models 30B-A3B --variants eager compile                 # the MoE model
    python benchmarks/pretrain_speed.py --device cpu --smoke [--models 30B-A3B]                   # the CPU check
    python benchmarks/pretrain_speed.py --models 8B --variants eager backend compile backend_compile  # issue 36

The ``backend`` rows train the same model built by the transformers backend (``--model.backend transformers`` from
the flavor's ``config.json``, its blocks cut in the config), for the backend-against-native row of issue 36.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import attempt, command_line, environment, number, vocab_tokenizer, write  # noqa: E402

TORCHTITAN_TABLE1 = {  # variant -> (tokens/s per GPU, peak GiB)
    "eager": (6258, 81.9),
    "compile": (6674, 77.0),
    "compile + float8 tensorwise": (9409, 76.8),
}
TORCHAO_TABLE3 = {  # variant -> (median tokens/s, peak GB)
    "compile": (6150, 47.65),
    "compile + float8 tensorwise": (7689.5, 47.77),
    "compile + float8 rowwise": (6768, 47.79),
}
COMPILE = ("--compile.enable",)
VARIANTS = {
    "eager": (),
    "compile": COMPILE,
    "compile + float8 tensorwise": (*COMPILE, "--float8.enable", "--float8.recipe", "tensorwise"),
    "compile + float8 rowwise": (*COMPILE, "--float8.enable", "--float8.recipe", "rowwise"),
    "transformers backend": (),
    "transformers backend + compile": COMPILE,
}
"""The rows; the backend's are the same model built by transformers' own code from its config.json (issue 36)."""
SHORT_NAMES = {"eager": "eager", "compile": "compile", "float8_tensorwise": "compile + float8 tensorwise",
               "float8_rowwise": "compile + float8 rowwise", "backend": "transformers backend",
               "backend_compile": "transformers backend + compile"}  # fmt: skip
"""``--variants`` names -> the table's rows."""
BASE = (
    "--job.config_file", "train_configs/debug_model.toml", "--data.kind", "synthetic", "--checkpoint.no_enable",
    "--training.mixed_precision_param", "bfloat16", "--optimizer.lr", "3e-4", "--lr_scheduler.warmup_steps", "2",
    "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op",
)  # fmt: skip


@dataclass(frozen=True)
class Model:
    name: str
    flavor: str
    local_batch: int
    layers: int | None = None
    """Blocks kept (None: the flavor's)."""
    paper: bool = False
    """Compared with the papers' Llama 3.1 8B rows."""
    family: str = "llama3"


def flops_scale(model: Model, seq_len: int) -> float:
    """FLOPs per token of the cut model over those of the full flavor (1.0 when nothing is cut)."""
    from titanium.models import build_model_args, get_model_spec

    spec = get_model_spec(model.family)
    full = build_model_args(spec, model.flavor, max_seq_len=seq_len)
    cut = dataclasses.replace(full, n_layers=model.layers or full.n_layers)
    return spec.flops_per_token(cut, seq_len) / spec.flops_per_token(full, seq_len)


def run(model: Model, variant: str, opts: argparse.Namespace, folder: Path) -> dict[str, float] | str:
    """The trainer's means for one row, or why there are none (the table still gets written)."""
    from titanium.models import build_model_args, get_model_spec

    spec = get_model_spec(model.family)
    args = build_model_args(spec, model.flavor)
    layers, chosen = model.layers, ["--model.name", model.family, "--model.flavor", model.flavor]
    if variant.startswith("transformers backend"):  # (the flavor's config.json, cut to the blocks kept)
        config = spec.hf_adapter.to_hf_config(dataclasses.replace(args, n_layers=layers or args.n_layers))
        config["max_position_embeddings"] = max(opts.seq_len, int(config.get("max_position_embeddings", 0)))
        source = folder.parent / "hf_config"
        source.mkdir(parents=True, exist_ok=True)
        (source / "config.json").write_text(json.dumps(config))
        layers, chosen = None, ["--model.hf_config", str(source), "--model.backend", "transformers"]
    flags = [
        *BASE, *chosen,
        "--tokenizer.path", str(vocab_tokenizer(folder.parent, args.vocab_size)),
        "--training.seq_len", str(opts.seq_len), "--training.local_batch_size", str(model.local_batch),
        "--training.steps", str(opts.steps), "--metrics.log_freq", str(opts.log_freq), *VARIANTS[variant],
    ]  # fmt: skip
    if opts.smoke:  # inductor on a small CPU takes minutes; float8 without tensor cores is emulated
        flags = [f for f in flags if f != "--compile.enable"] + (["--float8.emulate"] if "float8" in variant else [])
    return attempt(flags, folder, layers=layers, timeout=opts.run_timeout, cpu=opts.device == "cpu")


def table(model: Model, results: dict[str, dict[str, float] | str], seq_len: int) -> list[str]:
    scale = flops_scale(model, seq_len)  # (< 1 for a cut model: the full model does more per token)
    lines = [
        f"## {model.name}",
        "",
        "| variant | tokens/s/GPU | vs eager | tokens/s at full depth | MFU % | peak GiB | torchtitan Table 1 "
        "(tokens/s, GiB) | ratio | TorchAO Table 3 (tokens/s, GB) | ratio |",
        "|---|---:|---:|---:|---:|---:|---|---:|---|---:|",
    ]
    eager = results.get("eager")
    for variant, r in results.items():
        if isinstance(r, str):
            lines.append(f"| {variant} | {r} |  |  |  |  |  |  |  |  |")
            continue
        equivalent = r["tps"] * scale
        gain = f"{r['tps'] / eager['tps']:.2f}x" if isinstance(eager, dict) else "n/a"
        cells = [variant, number(r["tps"]), gain, number(equivalent), number(r["mfu"], ".1f")]
        cells.append(number(r["memory"], ".1f"))
        for paper in (TORCHTITAN_TABLE1, TORCHAO_TABLE3):
            if model.paper and variant in paper:
                tps, memory = paper[variant]
                cells += [f"{tps:,} tok/s, {memory}", f"{equivalent / tps:.2f}"]
            else:
                cells += ["", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--smoke", action="store_true", help="the debug model, 2 steps, 2 variants (a CPU check)")
    parser.add_argument("--models", nargs="+", default=["8B", "1B"], choices=["8B", "1B", "30B-A3B"])
    parser.add_argument(
        "--variants",
        nargs="+",
        default=[name for name in SHORT_NAMES if not name.startswith("backend")],
        choices=list(SHORT_NAMES),
        help="which rows to train",
    )
    parser.add_argument("--layers-8b", type=int, default=8, help="blocks of the 8B-shaped model (the real 8B: 32)")
    parser.add_argument("--layers-moe", type=int, default=3, help="blocks of the 30B-A3B-shaped model (real: 48)")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--log-freq", type=int, default=5)
    parser.add_argument("--run-timeout", type=float, default=240, help="seconds per run before it is given up")
    parser.add_argument("--out", type=Path, default=None, help="write the tables here (markdown)")
    opts = parser.parse_args()
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here; --device cpu --smoke runs the CPU check")
    models = {
        "8B": Model(f"Llama 3 8B-shaped, {opts.layers_8b} of 32 blocks", "8B", 2, opts.layers_8b, paper=True),
        "1B": Model("Llama 3.2 1B", "1B", 2),
        "30B-A3B": Model(
            f"Qwen3-30B-A3B-shaped, {opts.layers_moe} of 48 blocks", "30B-A3B", 2, opts.layers_moe, family="qwen3_moe"
        ),
    }
    variants = [SHORT_NAMES[v] for v in opts.variants]
    if opts.smoke:  # the debug model of the family asked for (MoE: eager only)
        moe = "30B-A3B" in opts.models
        debug = Model("Llama 3 debug model (smoke run)", "debugmodel", 2, 2, paper=True)
        if moe:
            debug = Model("Qwen3-MoE debug model (smoke run)", "debugmodel_moe", 2, 2, family="qwen3_moe")
        models, opts.models = {"debug": debug}, ["debug"]
        opts.seq_len, opts.steps, opts.log_freq = 64, 2, 1
        asked = [v for v in variants if v.startswith("transformers backend")]
        variants = ["eager"] if moe else ["eager", "compile + float8 tensorwise"] if not asked else ["eager", *asked]
    chosen = [models[m] for m in opts.models]
    lines = [
        "# Pretraining speed on one GPU" + (" (smoke run: debug model, no compile, emulated float8)" * opts.smoke),
        "",
        f"Command: `{command_line()}`. {environment(torch.device(opts.device))}",
        f"Sequence length {opts.seq_len}, {opts.steps} steps (means of the windows logged every {opts.log_freq} "
        "steps after step 1), bf16 autocast, selective AC (op), fused AdamW, synthetic tokens. See the script's "
        "docstring for the reference rows (quoted from the papers, measured on 8 H100s with FSDP).",
        "",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for model in chosen:
            results: dict[str, dict[str, float] | str] = {}
            for v in variants:  # the file after each row: a suite's time limit may stop the next one
                results[v] = run(model, v, opts, Path(tmp) / model.flavor / v.replace(" ", "_"))
                rows = table(model, results, opts.seq_len)
                write("\n".join(lines + rows), opts.out, echo=False)
            lines += rows
    write("\n".join(lines), opts.out)


if __name__ == "__main__":
    main()
