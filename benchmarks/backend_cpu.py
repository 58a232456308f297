"""The transformers backend against the native families on CPU: speed of the same job, and the losses of 10 steps in
each layout.

Llama 3 and Qwen3 debug shapes (every dimension of the ``debugmodel`` flavor), saved by ``transformers`` with random
weights, are trained from that folder with ``--model.backend native`` and ``--model.backend transformers``:

- speed: 20 steps of 8 rows of 256 synthetic tokens, float32, one process of one thread; the throughput clock is
  the process's CPU time (a shared machine's load makes wall-clock tok/s meaningless), mean of the steps after the
  first, best of ``--repeats`` runs;
- losses: 10 steps of 4 rows of 64 tokens (Adam with eps 0.1, as the parity test: tests/distributed/
  test_backend_parity.py) in one process, FSDP 2 (dp_shard 2) and TP 2; the last loss of each, and the largest
  relative difference of any step's loss from the native one-process run's.

    python benchmarks/backend_cpu.py              # writes benchmarks/results/backend_cpu.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))
from bench_common import TAGS, cpu_header, launcher, python_path, series, write  # noqa: E402

FAMILIES = ("llama3", "qwen3")
BACKENDS = ("native", "transformers")
LAYOUTS = {  # name: (processes, flags)
    "1 process": (1, ("--training.local_batch_size", "4")),
    "FSDP 2": (2, ("--training.local_batch_size", "2")),
    "TP 2": (2, ("--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2")),
}
LOSS_TAG = "loss_metrics/global_avg_loss"


def run(source: Path, backend: str, flags: tuple[str, ...], nproc: int = 1, cpu_clock: bool = False) -> Path:
    """One training run from ``source`` in a fresh process (or ``nproc``); its dump folder."""
    out = Path(tempfile.mkdtemp(prefix="run_", dir=source.parent))
    args = [
        "--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(out), "--job.no_print_config",
        "--checkpoint.no_enable", "--metrics.log_freq", "1", "--data.kind", "synthetic",
        "--training.mixed_precision_param", "float32", "--model.backend", backend,
        "--checkpoint.initial_load_path", str(source), "--checkpoint.initial_load_in_hf", *flags,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1"}
    cmd = [*launcher(nproc), __file__, "--worker", "cpu" if cpu_clock else "wall", *args]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if result.returncode:
        raise RuntimeError(f"run failed:\n{result.stderr[-3000:]}")
    return out


def speed(source: Path, backend: str, repeats: int) -> float:
    flags = ("--training.steps", "20", "--training.local_batch_size", "8", "--training.seq_len", "256")
    runs = []
    for _ in range(repeats):
        tps = series(run(source, backend, flags, cpu_clock=True), TAGS["tps"])
        runs.append(statistics.mean(v for step, v in tps.items() if step > 1))
    return max(runs)  # (a shared machine only ever slows a run down)


def losses(source: Path, backend: str, layout: str) -> dict[int, float]:
    nproc, flags = LAYOUTS[layout]
    common = ("--training.steps", "10", "--training.seq_len", "64", "--optimizer.eps", "0.1")
    return series(run(source, backend, (*common, *flags), nproc), LOSS_TAG)


def _worker(clock: str, argv: list[str]) -> int:
    """titanium.train, its throughput clock the process's CPU time with ``clock`` cpu."""
    if clock == "cpu":
        time.perf_counter = time.process_time  # (titanium.metrics.throughput looks it up at call time)
    from titanium.train import main

    return main(argv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="speed runs per cell; the table has the fastest")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/backend_cpu.md")
    opts = parser.parse_args()
    from tests.e2e.test_hf_train import make_hf_debug_checkpoint

    root = Path(tempfile.mkdtemp(prefix="backend_cpu_"))
    sources = {family: root / family for family in FAMILIES}
    for family, folder in sources.items():
        make_hf_debug_checkpoint(folder, family)
    speed_rows, loss_rows = [], []
    for family, source in sources.items():
        tps = {backend: speed(source, backend, opts.repeats) for backend in BACKENDS}
        ratio = tps["transformers"] / tps["native"]
        speed_rows.append(f"| {family} | {tps['native']:,.0f} | {tps['transformers']:,.0f} | {ratio:.2f}x |")
        print(speed_rows[-1], flush=True)
        reference = losses(source, "native", "1 process")
        for layout in LAYOUTS:
            got = {backend: losses(source, backend, layout) for backend in BACKENDS}
            gaps = {b: max(abs(v[s] - reference[s]) / abs(reference[s]) for s in reference) for b, v in got.items()}
            last = max(reference)
            loss_rows.append(
                f"| {family} | {layout} | {got['native'][last]:.6f} | {got['transformers'][last]:.6f} | "
                f"{gaps['native']:.1e} | {gaps['transformers']:.1e} |"
            )
            print(loss_rows[-1], flush=True)
    text = "\n".join(
        [
            *cpu_header("The transformers backend against the native families on CPU", 1),
            "",
            "Speed: the same job (debugmodel shape from a Hugging Face folder, 8 x 256 synthetic tokens a step, "
            "float32, 20 steps), tokens per CPU-second, mean of the steps after the first, best of "
            f"{opts.repeats} runs. Ratio: backend over native.",
            "",
            "| family | native | transformers backend | ratio |",
            "| --- | ---: | ---: | ---: |",
            *speed_rows,
            "",
            "Losses: 10 steps of 4 x 64 synthetic tokens from the same folder, Adam eps 0.1 (as "
            "tests/distributed/test_backend_parity.py); the loss of step 10, and the largest relative difference of "
            "any step's loss from the native one-process run's.",
            "",
            "| family | layout | native, step 10 | backend, step 10 | native vs 1 process | backend vs 1 process |",
            "| --- | --- | ---: | ---: | ---: | ---: |",
            *loss_rows,
            "",
        ]
    )
    write(text, opts.out)
    shutil.rmtree(root)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        sys.exit(_worker(sys.argv[2], sys.argv[3:]))
    main()
