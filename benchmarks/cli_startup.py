"""CPU-seconds a user waits before titanium's command line says anything: ``python -m titanium.train --help`` and
the preflight check of the debug job (``python -m titanium.preflight``, what ``run_train.sh`` runs before torchrun).

    python benchmarks/cli_startup.py [--repo PATH] [--runs 5]

Each command runs ``--runs`` times in a fresh process; the median of its CPU time (user + system, the child's
rusage) is printed, so a shared machine's load does not count. ``--repo`` measures another checkout (e.g. main, for
a before/after); results with the machine in benchmarks/results/cli_startup_cpu.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

COMMANDS = {
    "train --help": ["-m", "titanium.train", "--help"],
    "preflight (debug job)": ["-m", "titanium.preflight", "--job.config_file", "train_configs/debug_model.toml"],
    "convert --help": ["-m", "titanium.tools.convert", "--help"],
}


def cpu_seconds(repo: Path, args: list[str]) -> float:
    """The CPU time of one fresh ``python args`` process run in ``repo`` (with ``repo`` first on the path)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, *args], cwd=repo, env=env, capture_output=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    for name, command in COMMANDS.items():
        times = [cpu_seconds(args.repo, command) for _ in range(args.runs)]
        spread = f"{min(times):.2f}-{max(times):.2f}"
        print(f"{name}: {statistics.median(times):.2f} CPU-s (median of {args.runs}; {spread})")


if __name__ == "__main__":
    main()
