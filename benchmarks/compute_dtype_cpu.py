"""The debug job's speed on this CPU by compute dtype (``[training] mixed_precision_param``), as it is and held to
AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``: bf16 emulated, standing in for an AVX2-only CPU).

    python benchmarks/compute_dtype_cpu.py        # writes benchmarks/results/compute_dtype_cpu.md

Each cell is a fresh ``python -m titanium.train --job.config_file train_configs/debug_model.toml`` process. A shared
machine's load makes wall-clock tok/s meaningless, so by default each run has one thread and its throughput clock
is the process's CPU time (tokens per CPU-second); ``--clock wall --threads 0`` measures as a user sees it on an
idle machine. ``bfloat16`` is also what the default was before ``auto`` (issue 27). A second table times one
``nn.Linear`` forward and backward in bf16 autocast against float32 under each ISA limit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_common import TAGS, command_line, python_path, series, write  # noqa: E402

CPUS = {
    "this CPU": {},
    "held to AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}
"""CPU conditions: the environment each run gets."""
LINEAR_CPUS = {**CPUS, "held to AVX512 without BF16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}}
SETTINGS = ("auto", "float32", "bfloat16")


def run(setting: str, cpu_env: dict[str, str], steps: int, opts: argparse.Namespace) -> tuple[float, str]:
    """(mean tok/s over the steps after the first, the compute dtype the run logged) of one training run."""
    with tempfile.TemporaryDirectory() as out:
        flags = [
            "--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", out, "--job.no_print_config",
            "--checkpoint.no_enable", "--training.steps", str(steps), "--metrics.log_freq", "1",
            "--training.mixed_precision_param", setting,
        ]  # fmt: skip
        threads = {"OMP_NUM_THREADS": str(opts.threads)} if opts.threads else {}
        env = {**os.environ, "PYTHONPATH": python_path(), **threads, **cpu_env}
        cmd = [sys.executable, __file__, "--worker", opts.clock, *flags]
        result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
        if result.returncode:
            raise RuntimeError(f"run failed:\n{result.stderr[-3000:]}")
        chosen = next(line for line in result.stderr.splitlines() if "compute dtype" in line)
        tps = [v for step, v in series(Path(out), TAGS["tps"]).items() if step > 1]
        return statistics.mean(tps), chosen.split("compute dtype ")[1].split()[0]


def _worker(clock: str, argv: list[str]) -> int:
    """titanium.train, its throughput clock the process's CPU time with ``clock`` cpu."""
    if clock == "cpu":
        time.perf_counter = time.process_time  # (titanium.metrics.throughput looks it up at call time)
    from titanium.train import main

    return main(argv)


LINEAR = """
import time, torch
torch.set_num_threads(1)
x = torch.randn(2048, 256, requires_grad=True); lin = torch.nn.Linear(256, 768)
def best(autocast):
    times = []
    for _ in range(5):
        start = time.process_time()
        for _ in range(5):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = lin(x)
            y.float().sum().backward()
        times.append(time.process_time() - start)
    return min(times)
print(best(True) / best(False))
"""


def linear_ratio(cpu_env: dict[str, str]) -> float:
    """bf16 autocast time over float32 time of ``nn.Linear(256, 768)`` forward + backward on 2048 rows."""
    env = {**os.environ, **cpu_env}
    return float(subprocess.run([sys.executable, "-c", LINEAR], env=env, capture_output=True, text=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per run on this CPU")
    parser.add_argument("--emulated_steps", type=int, default=5, help="steps per run held to AVX2 (slow in bf16)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS; 0: torch's default")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    parser.add_argument("--repeats", type=int, default=2, help="runs per cell; the table has the fastest")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/compute_dtype_cpu.md")
    opts = parser.parse_args()
    import torch

    from titanium.precision import cpu_bf16_features

    rows = []
    for name, cpu_env in CPUS.items():
        cells = {}
        for setting in SETTINGS:
            steps = opts.steps if not cpu_env else opts.emulated_steps
            runs = [run(setting, cpu_env, steps, opts) for _ in range(opts.repeats)]
            cells[setting] = max(runs)  # (the best: a shared machine only ever slows a run down)
            print(f"{name:<14} {setting:<9} {cells[setting][0]:8,.0f} tok/s ({cells[setting][1]})", flush=True)
        auto, chosen = cells["auto"]
        rows.append(f"| {name} | {auto:,.0f} ({chosen}) | {cells['float32'][0]:,.0f} | {cells['bfloat16'][0]:,.0f} |")
    linear = [f"| {name} | {linear_ratio(cpu_env):.1f}x |" for name, cpu_env in LINEAR_CPUS.items()]
    unit = "tokens per CPU-second" if opts.clock == "cpu" else "tok/s"
    threads = f"{opts.threads} thread(s)" if opts.threads else "torch's default threads"
    load = os.getloadavg()
    native = ", ".join(cpu_bf16_features()) or "none"
    text = "\n".join(
        [
            "# Compute dtype on CPU: the debug job by `mixed_precision_param`",
            "",
            f"Command: `{command_line()}`. Device: {torch.cpu.get_capabilities()['cpu_name']} "
            f"({os.cpu_count()} cores, native bf16: {native}), torch {torch.__version__}, "
            f"{threads}, load {load[0]:.1f} at the end. Each cell: `python -m titanium.train --job.config_file "
            f"train_configs/debug_model.toml`, {unit} (mean of the steps after the first, best of {opts.repeats} runs; "
            f"{opts.steps} steps, {opts.emulated_steps} held to AVX2). bfloat16 is what the default was before `auto`.",
            "",
            "| CPU | auto | float32 | bfloat16 |",
            "| --- | ---: | ---: | ---: |",
            *rows,
            "",
            "One `nn.Linear(256, 768)` forward and backward on 2048 rows, one thread: bf16 autocast time over float32.",
            "",
            "| CPU | bf16 / float32 |",
            "| --- | ---: |",
            *linear,
            "",
        ]
    )
    write(text, opts.out)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        sys.exit(_worker(sys.argv[2], sys.argv[3:]))
    main()
