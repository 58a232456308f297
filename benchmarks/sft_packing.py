"""SFT throughput by row layout: tokens/s per device, useful (non-padding) tokens/s, memory.

Runs titanium.train on the same SFT config three ways: unpacked rows padded to seq_len (`--sft.no_packing
--sft.pad_to seq_len`), unpacked rows padded to each microbatch's longest sample (`--sft.pad_to longest`, what
`auto` gives without pipeline parallelism) and packed (`--sft.packing`), each `--repeats` times in turn (the
machine may be shared: alternating spreads its load over the layouts), and reads back what the runs logged to
TensorBoard (the mean over the logged steps after the first; the median over the repeats). Useful tokens/s is
tokens/s x (1 - padding share): the number packing and narrower rows are meant to raise.

    python benchmarks/sft_packing.py --out benchmarks/results/sft_packing_cpu.md              # debug model, CPU
    python benchmarks/sft_packing.py --config train_configs/qwen3_0.6b_sft.toml --steps 50 \\
        --out benchmarks/results/sft_packing_h100.md                                          # on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]
TAGS = {
    "tps": "throughput/tps",
    "padding": "data/padding_pct",
    "memory": "memory/peak_gib",
    "mfu": "throughput/mfu_pct",
    "loss": "loss_metrics/global_avg_loss",
}


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


LAYOUTS = {
    "padded to seq_len": ["--sft.no_packing", "--sft.pad_to", "seq_len"],
    "padded to the longest": ["--sft.no_packing", "--sft.pad_to", "longest"],
    "packed": ["--sft.packing"],
}


def run(config: str, layout: list[str], steps: int, folder: Path, extra: list[str]) -> dict[str, float]:
    args = [
        sys.executable, "-m", "titanium.train",
        "--job.config_file", config,
        "--job.dump_folder", str(folder),
        "--job.no_print_config",
        "--training.steps", str(steps),
        "--metrics.log_freq", "5",
        "--checkpoint.no_enable",
        "--eval.interval", "0",
        *layout,
        *extra,
    ]  # fmt: skip
    subprocess.run(args, cwd=REPO, check=True)
    acc = EventAccumulator(str(folder / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    out = {}
    for key, tag in TAGS.items():
        if tag in acc.Tags()["scalars"]:
            values = [e.value for e in acc.Scalars(tag) if e.step > 1] or [e.value for e in acc.Scalars(tag)]
            out[key] = statistics.mean(values)
    out["useful_tps"] = out["tps"] * (1 - out.get("padding", 0.0) / 100)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="train_configs/debug_sft.toml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each layout, in turn")
    parser.add_argument("--out", type=Path, default=None, help="write a markdown table here")
    parser.add_argument("extra", nargs="*", help="more config flags, after --")
    opts = parser.parse_args()
    # debug_sft.toml starts from the default job's checkpoint; throughput does not depend on the weights.
    extra = ["--checkpoint.initial_load_path", ""] + opts.extra if "debug_sft" in opts.config else opts.extra
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(opts.repeats):
            for name, layout in LAYOUTS.items():
                folder = Path(tmp) / f"{repeat}_{name.replace(' ', '_')}"
                runs[name].append(run(opts.config, layout, opts.steps, folder, extra))
    results = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    lines = [
        f"# SFT packing: {opts.config}, {opts.steps} steps",
        "",
        f"Device: {device_name()}, torch {torch.__version__}. Command: `python benchmarks/sft_packing.py "
        f"--config {opts.config} --steps {opts.steps} --repeats {opts.repeats}"
        f"{' -- ' + ' '.join(opts.extra) if opts.extra else ''}`.",
        f"Means over the logged steps after the first; medians over {opts.repeats} runs of each layout, in turn.",
        "",
        "| rows | tokens/s/device | padding | useful tokens/s/device | peak memory GiB | MFU % |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        mfu = f"{r['mfu']:.1f}" if "mfu" in r else "n/a"
        lines.append(
            f"| {name} | {r['tps']:,.0f} | {r.get('padding', 0):.1f}% | {r['useful_tps']:,.0f} | "
            f"{r.get('memory', float('nan')):.2f} | {mfu} |"
        )
    useful = {name: [r["useful_tps"] for r in rs] for name, rs in runs.items()}
    longest = [a / b for a, b in zip(useful["padded to the longest"], useful["padded to seq_len"])]
    packed = [a / b for a, b in zip(useful["packed"], useful["padded to seq_len"])]
    lines += [
        "",
        "Useful tokens/s against rows padded to seq_len, per repeat: padded to the longest "
        + ", ".join(f"{x:.2f}x" for x in longest)
        + f" (median {statistics.median(longest):.2f}x); packed "
        + ", ".join(f"{x:.2f}x" for x in packed)
        + f" (median {statistics.median(packed):.2f}x).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if opts.out:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(text)


if __name__ == "__main__":
    main()
