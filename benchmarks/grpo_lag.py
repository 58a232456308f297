"""GRPO with max_policy_lag 0, 1 and 2: step time, the share of generation hidden behind training, and reward.

    python benchmarks/grpo_lag.py --sft outputs/debug_sft/checkpoint/step-200     # after the debug SFT job
    python benchmarks/grpo_lag.py --sft ... --steps 4 --out ""                     # a quick look, no file written

Each lag trains ``train_configs/debug_grpo.toml`` (the debug model answering the bundled arithmetic tasks,
exact-match reward, titanium's rollout engine) from the same SFT checkpoint with the real trainer (one
``python -m titanium.train`` process, CPU), ``--prompts`` prompts x 8 responses per step, no evaluation. With lag 0
each batch is generated in ``prepare``; with lag > 0 the next one is generated on the generation thread while the
step trains (titanium/generation/background.py). From what the trainer logs every step: ``time/step_s`` (median
over the steps after the first), ``grpo/time/generate`` and ``grpo/time/wait`` summed over those steps (hidden:
1 - wait / generate, the share of generation the loop did not wait for), and ``grpo/reward`` (mean over all steps,
and over the last five).

OpenMP threads wait passively (``OMP_WAIT_POLICY=PASSIVE``): on a shared CPU with more runnable threads than cores,
libgomp's default spinning made every operation of the loop's thread 30-60x slower (measured here: 300 matmuls of
256x256 took 14-25 s instead of 0.43 s at load ~20 on 2 cores), and a second thread's OpenMP team switches it to
short spins, which made lag > 0 look ~10x faster for a reason that has nothing to do with the overlap.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]  # this checkout's titanium, then the shared helpers
from bench_common import cpu_header, python_path, series, table_rows, write  # noqa: E402


def run(lag: int, folder: Path, args: argparse.Namespace) -> dict[str, float] | str:
    """One GRPO run at ``lag``; its numbers, or why there are none."""
    flags = [
        "--job.config_file", "train_configs/debug_grpo.toml", "--job.dump_folder", str(folder), "--job.no_print_config",
        "--checkpoint.initial_load_path", str(args.sft), "--checkpoint.interval", str(10 * args.steps),
        "--eval.interval", "0", "--training.steps", str(args.steps),
        "--training.local_batch_size", str(8 * args.prompts), "--training.global_batch_size", str(8 * args.prompts),
        "--rl.max_policy_lag", str(lag), "--metrics.log_freq", "1", "--debug.seed", "0",
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": python_path(),
        "OMP_NUM_THREADS": str(args.threads),
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    try:
        subprocess.run(
            [sys.executable, "-m", "titanium.train", *flags], cwd=REPO, check=True, timeout=args.timeout, env=env
        )
    except subprocess.TimeoutExpired as e:
        return f"timed out after {e.timeout:.0f} s"
    except subprocess.CalledProcessError as e:
        return f"failed (exit {e.returncode}; its log is above)"
    generate = sum(series(folder, "grpo/time/generate").get(s, 0.0) for s in range(2, args.steps + 1))
    wait = sum(series(folder, "grpo/time/wait").get(s, 0.0) for s in range(2, args.steps + 1))
    steps = [v for step, v in series(folder, "time/step_s").items() if step > 1]
    rewards = [v for _, v in sorted(series(folder, "grpo/reward").items())]
    return {
        "step": statistics.median(steps) if steps else float("nan"),
        "generate": generate,
        "wait": wait,
        "hidden": round(1 - wait / generate, 3) + 0.0 if generate else float("nan"),  # (+ 0.0: no -0)
        "reward": statistics.fmean(rewards) if rewards else float("nan"),
        "reward_last": statistics.fmean(rewards[-5:]) if rewards else float("nan"),
    }


def cells(row: dict[str, float]) -> list[str]:
    out = [f"{row['step']:.2f}", f"{row['generate']:.1f}", f"{row['wait']:.1f}", f"{row['hidden']:.0%}"]
    return out + [f"{row['reward']:.4f}", f"{row['reward_last']:.4f}"]


def table(rows: dict[int, dict[str, float] | str], args: argparse.Namespace) -> str:
    lines = [
        *cpu_header("GRPO policy lag: overlap of generation with training, step time and reward (CPU)", args.threads),
        "",
        f"train_configs/debug_grpo.toml from the debug SFT checkpoint, {args.prompts} prompts x 8 responses per step, "
        f"{args.steps} steps, titanium engine. Step time: median of steps 2-{args.steps}; generate / waited: seconds "
        "summed over those steps; hidden: 1 - waited / generate; OMP_WAIT_POLICY=PASSIVE (script docstring).",
        "",
        "| max_policy_lag | step time (s) | generate (s) | waited (s) | hidden | reward (mean) | reward (last 5) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += table_rows(rows, cells, 7)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft", default=str(REPO / "outputs/debug_sft/checkpoint/step-200"))
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (8 responses each)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/grpo_lag_cpu.md"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = {lag: run(lag, Path(tmp) / f"lag{lag}", args) for lag in args.lags}
    write(table(rows, args), Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
