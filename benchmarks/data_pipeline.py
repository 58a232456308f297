"""The data pipeline alone (rows/s, tokens/s), and its share of a training step, inline and prefetched.

1. Pipeline alone: pretraining windows of the bundled corpus and packed SFT rows of the bundled chat task,
   read, tokenized and batched by titanium's loader (one data-parallel rank of one), timed over
   ``--batches`` batches after one warm-up batch. With ``--device cuda`` each batch is also pinned and
   copied to the GPU (non_blocking), as in training.
2. Share of a step: titanium.train on the debug model at the given shape (pretraining on the corpus, packed
   SFT on the chat task), with ``--data.prefetch_batches`` 0 (inline) and 2, reading back
   ``time/data_loading_pct`` (host time waiting for the next batch, as % of the step) and ``time/step_s``
   from TensorBoard, mean over the logged windows after the first.

    python benchmarks/data_pipeline.py --out benchmarks/results/data_pipeline_cpu.md
    python benchmarks/data_pipeline.py --device cuda --out benchmarks/results/data_pipeline_h100.md
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titanium.config.sections import DataSection, SFTSection, TokenizerSection  # noqa: E402
from titanium.data.chat import Llama3Template  # noqa: E402
from titanium.data.loader import BatchLoader  # noqa: E402
from titanium.data.packing import PackedDataset  # noqa: E402
from titanium.data.sft import SFTDataset  # noqa: E402
from titanium.data.text import RowReader, TextDataset  # noqa: E402
from titanium.data.tokenizer import build_tokenizer  # noqa: E402

TOKENIZER = TokenizerSection(kind="tiktoken", path=str(REPO / "assets/tokenizer/titanium_debug.tiktoken"))
CORPUS = str(REPO / "assets/corpus/train.jsonl")
CHAT = str(REPO / "assets/tasks/arithmetic/train.jsonl")


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def count_rows(reader: RowReader) -> list[int]:
    """Count the rows `reader` reads (a one-element list, updated as it reads)."""
    count, rows = [0], reader._rows

    def counting() -> Iterator:
        for row in rows():
            count[0] += 1
            yield row

    reader._rows = counting  # type: ignore[method-assign]
    return count


def pipeline_alone(name: str, reader: RowReader, rows, batch_size: int, batches: int, device: str) -> dict:
    """rows/s and tokens/s of `batches` batches from a fresh loader (inline, so the time is the pipeline's)."""
    parsed = count_rows(reader)
    loader = BatchLoader(rows, batch_size, prefetch=0, pin_memory=device == "cuda")
    next(loader)  # warm-up: opening files, first tokenizer calls
    start_rows, tokens = parsed[0], 0
    start = time.perf_counter()
    for _ in range(batches):
        batch = next(loader)
        if device == "cuda":
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        tokens += batch["input"].numel()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {
        "name": name,
        "rows_s": (parsed[0] - start_rows) / seconds,
        "tokens_s": tokens / seconds,
        "ms_per_batch": 1000 * seconds / batches,
    }


OBJECTIVES = {
    "pretrain": [],
    "sft": [
        "--training.objective",
        "sft",
        "--data.kind",
        "chat",
        "--data.path",
        CHAT,
        "--chat.chat_template",
        "llama3",
    ],
}
"""Training runs: pretraining on the bundled corpus, packed SFT on the bundled chat task."""


def run_training(objective: str, seq_len: int, batch: int, steps: int, prefetch: int, folder: Path) -> dict:
    args = [
        sys.executable, "-m", "titanium.train",
        "--job.config_file", str(REPO / "train_configs/debug_model.toml"),
        "--job.dump_folder", str(folder),
        "--job.no_print_config",
        "--training.steps", str(steps),
        "--training.seq_len", str(seq_len),
        "--training.local_batch_size", str(batch),
        "--metrics.log_freq", "5",
        "--checkpoint.no_enable",
        "--data.prefetch_batches", str(prefetch),
        *OBJECTIVES[objective],
    ]  # fmt: skip
    subprocess.run(args, cwd=REPO, check=True, capture_output=True)
    acc = EventAccumulator(str(folder / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    out = {}
    for key, tag in (("data_pct", "time/data_loading_pct"), ("step_s", "time/step_s"), ("tps", "throughput/tps")):
        values = [e.value for e in acc.Scalars(tag)][1:]  # the first window holds the warm-up step
        out[key] = statistics.mean(values)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=20, help="batches timed for the pipeline alone")
    parser.add_argument("--steps", type=int, default=16, help="training steps per run (logged every 5)")
    parser.add_argument("--objectives", nargs="+", choices=list(OBJECTIVES), default=list(OBJECTIVES))
    parser.add_argument("--out", type=Path, help="write a markdown table here")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    tokenizer = build_tokenizer(TOKENIZER)
    seq, bs = args.seq_len, args.batch_size

    text = TextDataset(DataSection(path=CORPUS), tokenizer, seq)
    sft = SFTDataset(DataSection(kind="chat", path=CHAT), SFTSection(), tokenizer, Llama3Template(tokenizer), seq)
    alone = [
        pipeline_alone("pretrain text windows (corpus)", text, text, bs, args.batches, args.device),
        pipeline_alone(
            "SFT chat, packed (arithmetic)", sft, PackedDataset(sft, seq, 0, 64), bs, args.batches, args.device
        ),
    ]
    steps = {}
    with tempfile.TemporaryDirectory() as tmp:
        for objective in args.objectives:
            for prefetch in (0, 2):
                folder = Path(tmp) / f"{objective}_prefetch{prefetch}"
                steps[objective, prefetch] = run_training(objective, seq, bs, args.steps, prefetch, folder)

    command = " ".join(["python", "benchmarks/data_pipeline.py", *sys.argv[1:]])
    lines = [
        "# Data pipeline",
        "",
        f"Device: {device_name(args.device)}; torch {torch.__version__}. Shape: seq_len {seq}, batch {bs}.",
        f"Command: `{command}`",
        "",
        "## The pipeline alone (one rank, inline: read, tokenize, pack, batch"
        + (", pin, copy)" if args.device == "cuda" else ")"),
        "",
        "| data | rows/s | tokens/s | ms per batch |",
        "|---|---:|---:|---:|",
        *(f"| {r['name']} | {r['rows_s']:,.0f} | {r['tokens_s']:,.0f} | {r['ms_per_batch']:.1f} |" for r in alone),
        "",
        f"## Share of a training step (debug model, {args.steps} steps, mean of the logged windows after the first)",
        "",
        "| objective | --data.prefetch_batches | data wait, % of step | step time (s) | tokens/s |",
        "|---|---:|---:|---:|---:|",
        *(f"| {o} | {p} | {s['data_pct']:.3f} | {s['step_s']:.3f} | {s['tps']:,.0f} |" for (o, p), s in steps.items()),
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
