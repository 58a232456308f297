"""Peak memory of DPO with the reference model online vs reference log-probs precomputed and cached.

    python benchmarks/dpo_memory.py                      # Qwen3 0.6B shape; CPU: ~15 minutes on 2 cores
    python benchmarks/dpo_memory.py --device cpu --smoke # Qwen3's debug flavor, 2 steps: the CPU check
    python benchmarks/dpo_memory.py --model llama3 --flavor debugmodel --steps 2   # another model

Each variant is a fresh ``python -m titanium.train`` process (one process, on ``--device``) of ``--steps`` DPO
steps from the same seeded weights on the first pairs of the bundled preference set; its log goes to this script's
output as it runs, and the table is rewritten after each variant, so a run stopped by a time limit keeps the
variants that finished:

- online: the frozen reference (a second copy of the model) runs in every step's prepare phase;
- precompute, first run: the reference is built, computes its log-probs for every pair once, is freed,
  and training reads the cache;
- precompute, cache present: a later run (or restart) with the first run's cache on disk: the reference is never
  built;
- LoRA online: rank-8 adapters on every linear layer; the reference is the policy with its adapters off.

Peak memory is the largest ``memory/peak_gib`` the loop logs (every step): on CUDA the caching allocator's peak
allocated bytes of each step (the precompute pass, before the first step, is not in it); on CPU the process's peak
resident set size (``getrusage`` ru_maxrss: live tensors plus what the allocator keeps, plus the Python and library
baseline, the same in every variant).

Attention: the pairs' rows share their prompt (``[dpo] share_prompt``), so attention takes a mask; ``auto`` would
pick FlexAttention on CUDA, which compiles in every process and for every row width (tens of seconds each on a GPU),
and at these lengths the mask is a few KiB, so the default is SDPA with a dense mask (what CPU runs use anyway).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_common import attempt, command_line, environment, series, table_rows, write  # noqa: E402

PRECOMPUTE = ("--dpo.precompute_reference",)
LORA = ("--lora.rank", "8", "--lora.target_modules", "attention", "mlp")
ONLINE = "online reference"
FIRST = "precompute, first run (computes the cache)"
CACHED = "precompute, cache present (reference never built)"
VARIANTS = {
    ONLINE: (),
    FIRST: PRECOMPUTE,
    CACHED: PRECOMPUTE,
    "LoRA (rank 8, attention + MLP), online reference = adapters off": LORA,
}
"""Table row -> the flags that make it, in the order they run (the cached run reads what the first one wrote)."""


def flags(opts: argparse.Namespace, work: Path) -> list[str]:
    """Every variant's job: the debug DPO config with the model, sizes and data replaced; the precompute runs share
    one cache folder (outside their dump folders)."""
    pairs = work / "pairs.jsonl"
    if not pairs.exists():
        lines = (REPO / "assets/tasks/arithmetic/preference_train.jsonl").read_text().splitlines(keepends=True)
        pairs.write_text("".join(lines[: opts.dataset_pairs]))
    return [
        "--job.config_file", str(REPO / "train_configs/debug_dpo.toml"),
        "--model.name", opts.model, "--model.flavor", opts.flavor, "--model.attention", opts.attention,
        "--checkpoint.no_enable", "--checkpoint.initial_load_path", "",
        "--eval.interval", "0",
        "--data.path", str(pairs),
        "--training.steps", str(opts.steps),
        "--training.local_batch_size", str(opts.pairs),
        "--training.seq_len", str(opts.seq_len),
        "--metrics.log_freq", "1",
        "--training.mixed_precision_param", "float32",
        "--dpo.reference_cache_folder", str(work / "reference_logps"),
    ]  # fmt: skip


def measure(job: list[str], folder: Path, opts: argparse.Namespace) -> dict[str, float] | str:
    """Peak GiB (the largest logged) and wall seconds of one training process, or why it gave none."""
    start = time.perf_counter()
    outcome = attempt(job, folder, timeout=opts.run_timeout, cpu=opts.device == "cpu", tags={})
    if isinstance(outcome, str):
        return outcome
    peaks = series(folder, "memory/peak_gib")
    if not peaks:
        return "no memory/peak_gib logged"
    return {"peak": max(peaks.values()), "seconds": time.perf_counter() - start}


def parameters(opts: argparse.Namespace) -> int:
    """The model's parameter count (built on the meta device: no memory, no time)."""
    from titanium.data.tokenizer import TiktokenTokenizer
    from titanium.models import build_model_args, get_model_spec

    vocab = TiktokenTokenizer(str(REPO / "assets/tokenizer/titanium_debug.tiktoken")).vocab_size
    spec = get_model_spec(opts.model)
    with torch.device("meta"):
        model = spec.model_cls(build_model_args(spec, opts.flavor, vocab_size=vocab, max_seq_len=opts.seq_len))
    return sum(p.numel() for p in model.parameters())


def table(results: dict[str, dict[str, float] | str], opts: argparse.Namespace, params: int) -> str:
    device = torch.device(opts.device)
    online = results.get(ONLINE)
    peak = (
        "CUDA: the caching allocator's peak allocated bytes of each step, the largest over the steps (the precompute "
        "pass, before the first step, is not in it)"
        if device.type == "cuda"
        else "CPU: the process's peak RSS from getrusage, including the Python and library baseline"
    )

    def cells(row: dict[str, float]) -> list[str]:
        vs = f"{row['peak'] - online['peak']:+.2f}" if isinstance(online, dict) else "n/a"
        return [f"{row['peak']:.2f}", vs, f"{row['seconds']:.0f}"]

    lines = [
        f"# DPO peak memory: online reference vs cached reference log-probs ({opts.model} {opts.flavor})",
        "",
        f"Command: `{command_line()}`. {environment(device)}",
        "",
        f"{opts.model} {opts.flavor} with the debug tokenizer ({params / 1e6:.0f}M parameters: "
        f"{params * 4 / 2**30:.2f} GiB in float32), {opts.steps} steps of {opts.pairs} pairs (each pair one row of "
        f"its prompt and both answers, up to 2 x {opts.seq_len} tokens), float32, attention {opts.attention}, one "
        "process per variant, from seeded weights.",
        f"Peak: the largest `memory/peak_gib` the loop logged ({peak}).",
        "",
        "| variant | peak memory (GiB) | vs online | wall time (s) |",
        "|---|---:|---:|---:|",
        *table_rows(results, cells, 4),
        "",
        f"The reference's own weights are {params / 1e6:.0f}M x 4 bytes = {params * 4 / 2**30:.2f} GiB. Wall times "
        "include each process's start and depend on the machine's other load at the time.",
    ]
    return "\n".join(lines) + "\n"


def run(opts: argparse.Namespace) -> str:
    """Every variant in turn; the table is written after each, and each finished row printed."""
    params = parameters(opts)
    results: dict[str, dict[str, float] | str] = {}
    with tempfile.TemporaryDirectory(prefix="dpo_memory_") as tmp:
        work = Path(tmp)
        job = flags(opts, work)
        for i, (name, extra) in enumerate(VARIANTS.items()):
            print(f"=== dpo_memory {i + 1}/{len(VARIANTS)}: {name}", flush=True)
            if name == CACHED and not any((work / "reference_logps").glob("*")):
                results[name] = "not run: the first precompute run left no cache"
            else:
                results[name] = measure([*job, *extra], work / f"variant_{i}", opts)
            row = results[name]
            done = row if isinstance(row, str) else f"{row['peak']:.2f} GiB, {row['seconds']:.0f} s"
            print(f"=== {name}: {done}", flush=True)
            write(table(results, opts, params), opts.out, echo=False)
    return table(results, opts, params)


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    cuda = torch.cuda.is_available()
    p.add_argument("--device", default="cuda" if cuda else "cpu", choices=["cuda", "cpu"], help="cuda if there is one")
    p.add_argument("--smoke", action="store_true", help="the model's debug flavor and 2 steps (a CPU check)")
    p.add_argument("--model", default="qwen3", help="[model] name")
    p.add_argument("--flavor", default="0.6B", help="[model] flavor")
    p.add_argument("--pairs", type=int, default=2, help="pairs per step")
    p.add_argument("--seq-len", type=int, default=64, help="training.seq_len")
    p.add_argument("--steps", type=int, default=3, help="DPO steps per variant")
    p.add_argument("--dataset-pairs", type=int, default=16, help="pairs in the data (the precompute pass reads all)")
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "flex", "auto"], help="[model] attention (above)")
    p.add_argument("--run-timeout", type=float, default=None, help="seconds per variant before it is given up")
    p.add_argument("--out", type=Path, default=None, help="None: benchmarks/results/dpo_memory_<device>.md")
    return p


def main() -> None:
    opts = parser().parse_args()
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here; --device cpu runs on the CPU")
    if opts.smoke:
        opts.flavor, opts.steps = "debugmodel", 2
    opts.out = opts.out or REPO / f"benchmarks/results/dpo_memory_{opts.device}.md"
    write(run(opts), opts.out)


if __name__ == "__main__":
    main()
