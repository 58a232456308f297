"""The torchtune paper's single-GPU SFT ladder on titanium: Qwen3 0.6B / 1.7B / 4B at sequence length 2048.

Table 2 turns the optimizations on one after another, each row keeping the ones above it:
  baseline: bf16, 2 sequences per microbatch, 8 microbatches per step, one conversation per row (padded)
  + LCE          --training.loss_chunk_size 1024 (chunked linear cross-entropy)
  + Compile      --compile.enable
  + AC           --activation_checkpoint.mode full
  + Optim Bwd    --optimizer.early_step_in_backward, 16 sequences and no accumulation (as the paper), no clipping
  + AdamW8Bit    --optimizer.name AdamW8bit (torchao's)
Table 3 starts from the "+ AC" row and packs the conversations into rows of 2048 and of 4096 tokens.

Each row is a fresh ``python -m titanium.train`` run on one GPU (random weights: throughput does not depend on
them) and reads back the trainer's tokens/s per device, padding share and peak memory (means of the windows
logged after step 1). The data is the bundled arithmetic chats unless ``--data-path`` names another chat file
(e.g. a local copy of Alpaca with ``--data-kind instruct``, the paper's data); the tokenizer is a generated file
of Qwen3's vocabulary size (151,936 ids; no hub download), with titanium's Llama 3 chat format. Useful tokens/s
excludes padding; the paper's tokens/s is beside it (it does not say which tokens it counts) with the ratio.
Memory is not like for like: titanium on one GPU keeps float32 weights and AdamW state and autocasts to bf16.

    python benchmarks/sft_ladder.py --out benchmarks/results/sft_ladder_h100.md         # one GPU (not timed yet)
    python benchmarks/sft_ladder.py --device cpu --smoke                                 # the CPU check
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import attempt, command_line, environment, number, vocab_tokenizer, write  # noqa: E402

QWEN3_VOCAB = 151936
DEFAULT_DATA = "assets/tasks/arithmetic/train.jsonl"
LADDER = {  # row -> flags added to the rows above it
    "baseline": (),
    "+ LCE": ("--training.loss_chunk_size", "1024"),
    "+ Compile": ("--compile.enable",),
    "+ AC": ("--activation_checkpoint.mode", "full"),
    "+ Optim Bwd": (
        "--optimizer.early_step_in_backward", "--training.max_norm", "0",
        "--training.local_batch_size", "16", "--training.global_batch_size", "-1",
    ),
    "+ AdamW8Bit": ("--optimizer.name", "AdamW8bit"),
}  # fmt: skip
SMOKE = ["--training.seq_len", "128", "--training.global_batch_size", "2"]
PACKED = {"+ Packed 2048": ("--sft.packing",), "+ Packed 4096": ("--sft.packing", "--training.seq_len", "4096")}
TORCHTUNE_TABLE2 = {  # torchtune paper, Table 2 (one H100, full weight): row -> (memory GB, tokens/s) per model
    "0.6B": [(8.60, 5213), (8.41, 5454), (6.96, 7872), (5.47, 4836), (6.1, 20384), (3.67, 15369)],
    "1.7B": [(18.48, 8071), (19.49, 7806), (15.2, 9621), (13.95, 7568), (11.65, 6743), (4.92, 3873)],
    "4B": [(31.52, 2801), (31, 3099), (31, 3755), (30, 2983), (24.37, 2523), (9.50, 1366)],
}
TORCHTUNE_TABLE3 = {  # torchtune paper, Table 3 (one H100): + Packed 2048, + Packed 4096
    "0.6B": [(11.79, 57031), (18.37, 85924)],
    "1.7B": [(15.88, 29466), (17.81, 34343)],
    "4B": [(33.92, 13538), (36.15, 15272)],
}


def base_flags(opts: argparse.Namespace, folder: Path) -> list[str]:
    vocab = 2256 if opts.smoke else QWEN3_VOCAB  # (the debug flavor's)
    return [
        "--job.config_file", "train_configs/debug_sft.toml", "--checkpoint.no_enable",
        "--checkpoint.initial_load_path", "", "--eval.interval", "0", "--sft.no_packing",
        "--tokenizer.kind", "tiktoken", "--tokenizer.path", str(vocab_tokenizer(folder, vocab)),
        "--chat.chat_template", "llama3", "--data.kind", opts.data_kind, "--data.path", opts.data_path,
        "--training.seq_len", "2048", "--training.local_batch_size", "2", "--training.global_batch_size", "16",
        "--training.mixed_precision_param", "bfloat16", "--optimizer.lr", "2e-5", "--lr_scheduler.warmup_steps", "2",
        "--training.steps", str(opts.steps), "--metrics.log_freq", str(opts.log_freq),
    ]  # fmt: skip


def row_flags(name: str) -> list[str]:
    """The flags of a row: those of every ladder row up to it (a packed row: up to "+ AC"), then its own."""
    last = name if name in LADDER else "+ AC"
    ladder = list(LADDER)
    flags = [f for row in ladder[: ladder.index(last) + 1] for f in LADDER[row]]
    return flags + list(PACKED.get(name, ()))


def rows(flavor: str, opts: argparse.Namespace, folder: Path) -> dict[str, dict[str, float] | str]:
    """The results of each chosen row (or why it has none)."""
    model = ["--model.name", "qwen3", "--model.flavor", "debugmodel" if opts.smoke else flavor]
    results: dict[str, dict[str, float] | str] = {}
    for name in opts.rows:
        flags = [*base_flags(opts, folder), *model, *row_flags(name)]
        if opts.smoke:  # small rows, one microbatch; inductor on a small CPU takes minutes
            flags = [f for f in flags if f != "--compile.enable"] + SMOKE
        results[name] = attempt(flags, folder / name, timeout=opts.run_timeout, cpu=opts.device == "cpu")
    return results


def table(flavor: str, results: dict[str, dict[str, float] | str], smoke: bool) -> list[str]:
    papers = dict(zip([*LADDER, *PACKED], [*TORCHTUNE_TABLE2[flavor], *TORCHTUNE_TABLE3[flavor]]))
    lines = [
        f"## Qwen3 {flavor}" + (" (smoke run: Qwen3's debug flavor in its place, rows of 128 tokens)" * smoke),
        "",
        "| row | tokens/s | padding | useful tokens/s | peak GiB | torchtune (GB, tokens/s) | ratio (useful) |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for name, r in results.items():
        memory, tps = papers[name]
        paper = f"{memory} GB, {tps:,} tok/s ({'Table 2' if name in LADDER else 'Table 3'})"
        if isinstance(r, str):
            lines.append(f"| {name} | {r} |  |  |  | {paper} |  |")
            continue
        padding = 0.0 if r["padding"] != r["padding"] else r["padding"]
        useful = r["tps"] * (1 - padding / 100)
        lines.append(
            f"| {name} | {number(r['tps'])} | {padding:.0f}% | {number(useful)} | {number(r['memory'], '.1f')} | "
            f"{paper} | {useful / tps:.2f} |"
        )
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--smoke", action="store_true", help="Qwen3's debug flavor, 2 steps, 2 rows (a CPU check)")
    parser.add_argument("--models", nargs="+", default=["0.6B", "1.7B", "4B"], choices=list(TORCHTUNE_TABLE2))
    parser.add_argument("--rows", nargs="+", default=[*LADDER, *PACKED], choices=[*LADDER, *PACKED])
    parser.add_argument("--data-path", default=DEFAULT_DATA)
    parser.add_argument("--data-kind", default="chat", choices=["chat", "instruct"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--log-freq", type=int, default=3)
    parser.add_argument("--run-timeout", type=float, default=150, help="seconds per run before it is given up")
    parser.add_argument("--out", type=Path, default=None, help="write the tables here (markdown)")
    opts = parser.parse_args()
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here; --device cpu --smoke runs the CPU check")
    if opts.smoke:
        opts.models, opts.rows, opts.steps, opts.log_freq = ["0.6B"], ["baseline", "+ LCE"], 2, 1
    lines = [
        "# SFT ladder on one GPU (torchtune paper, Tables 2 and 3)" + (" (smoke run: debug flavor)" * opts.smoke),
        "",
        f"Command: `{command_line()}`. {environment(torch.device(opts.device))}",
        f"Data: `{opts.data_path}` ({opts.data_kind}); {opts.steps} steps per row, means of the windows logged every "
        f"{opts.log_freq} steps after step 1. The flags of each row and the reference setup are in the script's "
        "docstring.",
        "",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for flavor in opts.models:
            lines += table(flavor, rows(flavor, opts, Path(tmp) / flavor), opts.smoke)
            write("\n".join(lines), opts.out, echo=False)  # (a suite's time limit may stop the next model)
    write("\n".join(lines), opts.out)


if __name__ == "__main__":
    main()
