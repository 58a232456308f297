"""Peak memory of DPO with the reference model online vs reference log-probs precomputed and cached.

    python benchmarks/dpo_memory.py                      # Qwen3 0.6B shape, CPU, ~10 minutes on 2 cores
    python benchmarks/dpo_memory.py --model llama3 --flavor debugmodel --steps 2   # a quick look

Each variant is a fresh ``python -m titanium.train`` process (one process; CUDA if present, else CPU) of
``--steps`` DPO steps from the same seeded weights on the first pairs of the bundled preference set:

- online: the frozen reference (a second copy of the model) runs in every step's prepare phase;
- precompute, first run: the reference is built, computes its log-probs for every pair once, is freed,
  and training reads the cache;
- precompute, cache present: a later run (or restart) with the cache on disk: the reference is never built;
- LoRA online: rank-8 adapters on every linear layer; the reference is the policy with its adapters off.

Peak memory is what the loop logs as ``memory/peak_gib``: on CUDA the caching allocator's peak allocated
bytes; on CPU the process's peak resident set size (``getrusage`` ru_maxrss: live tensors plus what the
allocator keeps, plus the Python and library baseline, the same in every variant). The table goes to
``--out`` with the machine and the command.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_common import python_path  # noqa: E402


def last_scalar(tb: Path, tag: str) -> float:
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    return acc.Scalars(tag)[-1].value


def train(folder: Path, args: argparse.Namespace, pairs: Path, *extra: str) -> tuple[float, float]:
    """(peak GiB, wall seconds) of one training process writing to ``folder``."""
    cmd = [
        sys.executable, "-m", "titanium.train",
        "--job.config_file", str(REPO / "train_configs/debug_dpo.toml"),
        "--job.dump_folder", str(folder),
        "--job.no_print_config",
        "--model.name", args.model, "--model.flavor", args.flavor,
        "--checkpoint.no_enable", "--checkpoint.initial_load_path", "",
        "--eval.interval", "0",
        "--data.path", str(pairs),
        "--training.steps", str(args.steps),
        "--training.local_batch_size", str(args.pairs),
        "--training.seq_len", str(args.seq_len),
        "--metrics.log_freq", "1",
        "--training.mixed_precision_param", "float32",
        *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": python_path(), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    return last_scalar(folder / "tb", "memory/peak_gib"), time.perf_counter() - start


def parameters(args: argparse.Namespace) -> int:
    from titanium.data.tokenizer import TiktokenTokenizer
    from titanium.models import build_model_args, get_model_spec

    vocab = TiktokenTokenizer(str(REPO / "assets/tokenizer/titanium_debug.tiktoken")).vocab_size
    spec = get_model_spec(args.model)
    with torch.device("meta"):
        model = spec.model_cls(build_model_args(spec, args.flavor, vocab_size=vocab, max_seq_len=args.seq_len))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3")
    p.add_argument("--flavor", default="0.6B")
    p.add_argument("--pairs", type=int, default=2, help="pairs per step (2 x as many rows)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dataset-pairs", type=int, default=16, help="pairs in the data (the precompute pass reads all)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/dpo_memory_cpu.md")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="dpo_memory_"))
    try:
        pairs = work / "pairs.jsonl"
        lines = (REPO / "assets/tasks/arithmetic/preference_train.jsonl").read_text().splitlines(keepends=True)
        pairs.write_text("".join(lines[: args.dataset_pairs]))
        lora = ("--lora.rank", "8", "--lora.target_modules", "attention", "mlp")
        cached = ("--dpo.precompute_reference",)
        rows = [
            ("online reference", train(work / "online", args, pairs)),
            ("precompute, first run (computes the cache)", train(work / "cached", args, pairs, *cached)),
            ("precompute, cache present (reference never built)", train(work / "cached", args, pairs, *cached)),
            (
                "LoRA (rank 8, attention + MLP), online reference = adapters off",
                train(work / "lora", args, pairs, *lora),
            ),
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    cpu = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else cpu
    params = parameters(args)
    base = rows[0][1][0]
    lines = [
        f"# DPO peak memory: online reference vs cached reference log-probs ({args.model} {args.flavor})",
        "",
        f"Device: {device}; torch {torch.__version__}. {args.model} {args.flavor} with the debug tokenizer "
        f"({params / 1e6:.0f}M parameters: {params * 4 / 2**30:.2f} GiB in float32), {args.steps} steps of "
        f"{args.pairs} pairs ({2 * args.pairs} rows of {args.seq_len} tokens), float32, one process, from seeded "
        "weights.",
        "Peak: `memory/peak_gib` as the loop logs it (CPU: peak RSS from getrusage, including the Python and "
        "library baseline; CUDA: peak allocated).",
        "",
        "| variant | peak memory (GiB) | vs online | wall time (s) |",
        "|---|---|---|---|",
    ]
    for name, (peak, seconds) in rows:
        lines.append(f"| {name} | {peak:.2f} | {peak - base:+.2f} | {seconds:.0f} |")
    command = " ".join(["python benchmarks/dpo_memory.py", *sys.argv[1:]])
    lines += [
        "",
        f"The reference's own weights are {params / 1e6:.0f}M x 4 bytes = {params * 4 / 2**30:.2f} GiB. Wall times "
        "depend on the machine's other load at the time.",
        "",
        f"Command: `{command}`",
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
