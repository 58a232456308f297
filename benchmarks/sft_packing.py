"""SFT throughput with and without packing: tokens/s per device, useful (non-padding) tokens/s, memory.

Runs titanium.train twice on the same SFT config, with `--sft.packing` and `--sft.no_packing`, and reads
back what the runs logged to TensorBoard (the mean over the logged steps after the first). Useful tokens/s
is tokens/s x (1 - padding share): the number packing is meant to raise.

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


def run(config: str, packing: bool, steps: int, folder: Path, extra: list[str]) -> dict[str, float]:
    args = [
        sys.executable, "-m", "titanium.train",
        "--job.config_file", config,
        "--job.dump_folder", str(folder),
        "--job.no_print_config",
        "--training.steps", str(steps),
        "--metrics.log_freq", "5",
        "--checkpoint.no_enable",
        "--eval.interval", "0",
        "--sft.packing" if packing else "--sft.no_packing",
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
    parser.add_argument("--out", type=Path, default=None, help="write a markdown table here")
    parser.add_argument("extra", nargs="*", help="more config flags, after --")
    opts = parser.parse_args()
    # debug_sft.toml starts from the default job's checkpoint; throughput does not depend on the weights.
    extra = ["--checkpoint.initial_load_path", ""] + opts.extra if "debug_sft" in opts.config else opts.extra
    with tempfile.TemporaryDirectory() as tmp:
        results = {
            name: run(opts.config, name == "packed", opts.steps, Path(tmp) / name, extra)
            for name in ("padded", "packed")
        }
    lines = [
        f"# SFT packing: {opts.config}, {opts.steps} steps",
        "",
        f"Device: {device_name()}, torch {torch.__version__}. Command: `python benchmarks/sft_packing.py "
        f"--config {opts.config} --steps {opts.steps}{' ' + ' '.join(opts.extra) if opts.extra else ''}`.",
        "Means over the logged steps after the first.",
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
    gain = results["packed"]["useful_tps"] / results["padded"]["useful_tps"]
    lines += ["", f"Packing: {gain:.2f}x the useful tokens per second."]
    text = "\n".join(lines) + "\n"
    print(text)
    if opts.out:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(text)


if __name__ == "__main__":
    main()
