"""Knowledge distillation against SFT alone, end to end on the bundled arithmetic chat task (issue 24).

1. A teacher (``kd_teacher``: the debug Llama 3 cut to dim 128, 4 blocks) is trained by SFT from its seeded
   initialization on ``assets/tasks/arithmetic/train.jsonl``.
2. For each seed, the same small student (``kd_student``: dim 64, 2 blocks) is trained twice from the same seeded
   initialization, on the same data in the same order, for the same number of steps: by SFT alone, and by
   ``--training.objective kd`` from the teacher's last checkpoint (forward KL, ``--alpha``, ``--temperature``).
3. Each run's held-out exact match (greedy answers to the first ``--eval-samples`` rows of
   ``assets/tasks/arithmetic/test.jsonl``, the trainer's ``[eval]``, titanium/evaluation/exact_match.py) after its
   last step is read back from its TensorBoard scalars, with the student's cross-entropy on its training batches
   (``kd/ce`` for KD; the loss for SFT).

Every run is a fresh ``python -m titanium.train`` process (this script registers the two flavors in it first),
on the CPU, in float32. The results file lists every seed, the means and the command.

    python benchmarks/kd_vs_sft.py --out benchmarks/results/kd_vs_sft_cpu.md              # teacher + 300 steps
    python benchmarks/kd_vs_sft.py --reuse-teacher --student-steps 450 --out results.md   # the same teacher, 450
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import REPO, command_line, python_path, series, write  # noqa: E402

FLAVORS = {  # name -> changes to the debug Llama 3 flavor (vocabulary 2256: the debug tokenizer's)
    "kd_teacher": {"dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 64},
    "kd_student": {"dim": 64, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "multiple_of": 64},
}
EM, LOSS, CE = "eval/exact_match", "loss_metrics/global_avg_loss", "kd/ce"


def common_flags(opts: argparse.Namespace, steps: int, seed: int, eval_interval: int) -> list[str]:
    return [
        "--job.config_file", "train_configs/debug_sft.toml", "--job.no_print_config",
        "--checkpoint.initial_load_path", "", "--training.mixed_precision_param", "float32",
        "--training.seq_len", str(opts.seq_len), "--training.local_batch_size", str(opts.batch),
        "--training.steps", str(steps), "--lr_scheduler.warmup_steps", str(max(1, steps // 10)),
        "--optimizer.lr", str(opts.lr), "--debug.seed", str(seed), "--metrics.log_freq", str(max(1, steps // 5)),
        "--eval.interval", str(eval_interval), "--eval.max_samples", str(opts.eval_samples),
    ]  # fmt: skip


def run(flags: list[str], folder: Path, log: Path) -> float:
    """One training run in its own process (the flavors registered first); its wall-clock seconds."""
    cmd = [sys.executable, __file__, "--child", "--", *flags, "--job.dump_folder", str(folder)]
    env = {**os.environ, "PYTHONPATH": python_path(), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    with log.open("w") as out:
        subprocess.run(cmd, cwd=REPO, check=True, env=env, stdout=out, stderr=subprocess.STDOUT)
    return time.perf_counter() - start


def last(folder: Path, tag: str) -> float:
    values = series(folder, tag)
    return values[max(values)] if values else float("nan")


def main(opts: argparse.Namespace) -> None:
    work = Path(opts.work)
    work.mkdir(parents=True, exist_ok=True)
    teacher = work / "teacher"
    t = opts.teacher_steps
    teacher_flags = [
        *common_flags(opts, t, 0, t), "--model.flavor", "kd_teacher",
        "--checkpoint.enable", "--checkpoint.interval", str(t), "--checkpoint.keep_latest_k", "1",
    ]  # fmt: skip
    teacher_ckpt = teacher / "checkpoint" / f"step-{t}"
    seconds = {}
    if not (opts.reuse_teacher and teacher_ckpt.is_dir()):
        seconds["teacher"] = run(teacher_flags, teacher, work / "teacher.log")
    rows = []
    for seed in opts.seeds:
        s = opts.student_steps
        base = [*common_flags(opts, s, seed, s), "--model.flavor", "kd_student", "--checkpoint.no_enable"]
        kd = [
            "--training.objective", "kd", "--kd.teacher_path", str(teacher_ckpt), "--kd.teacher_flavor",
            "kd_teacher", "--kd.alpha", str(opts.alpha), "--kd.temperature", str(opts.temperature),
        ]  # fmt: skip
        row = {"seed": seed}
        for name, extra in (("sft", []), ("kd", kd)):
            folder = work / f"{name}_seed{seed}"
            seconds[f"{name} {seed}"] = run([*base, *extra], folder, work / f"{name}_seed{seed}.log")
            row[name] = last(folder, EM)
            row[f"{name}_ce"] = last(folder, CE if name == "kd" else LOSS)
        rows.append(row)
        print(row, flush=True)
    write(report(opts, last(teacher, EM), last(teacher, LOSS), rows, seconds), Path(opts.out) if opts.out else None)


def report(opts, teacher_em: float, teacher_loss: float, rows: list[dict], seconds: dict[str, float]) -> str:
    from titanium.models import get_model_spec

    register_flavors()
    params = {name: flavor_params(get_model_spec("llama3").flavors[name]) for name in FLAVORS}
    kd_wins = sum(r["kd"] > r["sft"] for r in rows)
    lines = [
        "# Knowledge distillation vs SFT alone (bundled arithmetic task, CPU)",
        "",
        f"Command: `{command_line()}`",
        "",
        f"Teacher `kd_teacher` ({params['kd_teacher'] / 1e6:.2f}M parameters, {FLAVORS['kd_teacher']}) trained by "
        f"SFT for {opts.teacher_steps} steps: held-out exact match {100 * teacher_em:.1f}% (training loss "
        f"{teacher_loss:.3f} at its last step). Students `kd_student` ({params['kd_student'] / 1e6:.2f}M "
        f"parameters, {FLAVORS['kd_student']}), {opts.student_steps} steps each, {opts.batch} packed rows of "
        f"{opts.seq_len} tokens per step, lr {opts.lr}, float32; KD: forward KL, alpha {opts.alpha}, T "
        f"{opts.temperature}. Exact match: greedy answers to the first {opts.eval_samples} rows of "
        "assets/tasks/arithmetic/test.jsonl after the last step. Train CE: the student's cross-entropy on the "
        "training batches at the last logged step (SFT: its loss; KD: `kd/ce`).",
        "",
        "| seed | SFT exact match | KD exact match | KD - SFT | SFT train CE | KD train CE |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seed']} | {100 * r['sft']:.1f}% | {100 * r['kd']:.1f}% | {100 * (r['kd'] - r['sft']):+.1f} | "
            f"{r['sft_ce']:.3f} | {r['kd_ce']:.3f} |"
        )
    sft_mean, kd_mean = statistics.mean(r["sft"] for r in rows), statistics.mean(r["kd"] for r in rows)
    lines += [
        f"| mean | {100 * sft_mean:.1f}% | {100 * kd_mean:.1f}% | {100 * (kd_mean - sft_mean):+.1f} | | |",
        "",
        f"KD beat SFT on {kd_wins} of {len(rows)} seeds.",
        "",
        "Wall-clock seconds per run (a shared CPU): "
        + ", ".join(f"{name} {value:.0f}" for name, value in seconds.items())
        + ".",
        "",
    ]
    return "\n".join(lines)


def flavor_params(args) -> int:
    import torch

    from titanium.models import get_model_spec

    with torch.device("meta"):
        model = get_model_spec("llama3").model_cls(args)
    return sum(p.numel() for p in model.parameters())


def register_flavors() -> None:
    """The benchmark's two flavors, in this process's registry (the children register them too)."""
    from titanium.models import get_model_spec

    flavors = get_model_spec("llama3").flavors
    for name, changes in FLAVORS.items():
        flavors[name] = dataclasses.replace(flavors["debugmodel"], **changes)


def child(argv: list[str]) -> int:
    from titanium.train import main as train_main

    register_flavors()
    return train_main(argv)


if __name__ == "__main__":
    if "--child" in sys.argv:
        sys.exit(child(sys.argv[sys.argv.index("--") + 1 :]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher-steps", type=int, default=500)
    parser.add_argument("--student-steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--seq-len", type=int, default=96)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--eval-samples", type=int, default=128)
    parser.add_argument("--work", default="/tmp/kd_vs_sft", help="where the runs write (checkpoints, logs)")
    parser.add_argument("--out", default=None, help="the results file (markdown)")
    parser.add_argument("--reuse-teacher", action="store_true", help="keep a teacher an earlier run left in --work")
    main(parser.parse_args())
