"""GRPO on one GPU at Qwen3-1.7B's shape: generation tokens/s, weight-sync seconds, reference and train seconds and
the step time, with titanium's rollout engine (vLLM is not among the GPU machine's wheels).

    python benchmarks/grpo_gpu.py --out benchmarks/results/grpo_h100.md     # one GPU (part 6 of gpu_suite.sh)
    python benchmarks/grpo_gpu.py --device cpu --smoke                      # the CPU check of the same code

Each variant is a fresh ``python -m titanium.train`` run of the real GRPO loop on one device: Qwen3 1.7B with random
weights (speed does not depend on them), a tokenizer file of Qwen3's vocabulary size (151,936 ids; no hub
download), the bundled arithmetic prompts in the Llama 3 chat format, ``--prompts`` prompts x 8 responses per step
of up to ``--max-new-tokens`` tokens (a random policy rarely samples a stop id, so nearly every response is that
long), a rollout batch every step, old log-probs recomputed by the trained policy (TRL's default) and a KL reference
(beta 0.04), so every part of the step runs; bfloat16 compute. Variants:

    lag0       generation in the loop, before the step that trains on it (fully on-policy)
    lag1       max_policy_lag 1: the next batch is generated on the generation thread (on a CUDA stream of its own)
               while the step trains
    compiled   lag0 with the engine's decode step compiled (``--rollout.compile``, static cache)

The columns are what the trainer logs every step (``grpo/time/<part>``: seconds per step; ``generate`` is
generation's own time, ``wait`` the part of it the loop waited for; ``grpo/gen_tokens_per_s``; ``time/step_s`` the
loop's step time; ``memory/peak_gib``), each the mean over the steps after the first (start-up and warm-up).
``--smoke`` runs Qwen3's debug flavor with the debug tokenizer and 3 steps of short responses.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import attempt, command_line, environment, number, table_rows, vocab_tokenizer, write  # noqa: E402

QWEN3_VOCAB = 151936
TAGS = {
    **{part: f"grpo/time/{part}" for part in ("generate", "wait", "old_logprobs", "reference", "sync", "train")},
    "tps": "grpo/gen_tokens_per_s",
    "step": "time/step_s",
    "memory": "memory/peak_gib",
}
VARIANTS = {
    "lag0": (),
    "lag1": ("--rl.max_policy_lag", "1"),
    "compiled": ("--rollout.compile",),
}
COLUMNS = ("generate", "tps", "wait", "old_logprobs", "reference", "sync", "train", "step", "memory")


def flags(opts: argparse.Namespace, folder: Path) -> list[str]:
    """The job of every variant: the debug GRPO config with the model, sizes and timing switches replaced."""
    model = ["--model.name", "qwen3", "--model.flavor", "debugmodel" if opts.smoke else "1.7B"]
    tokenizer = [] if opts.smoke else ["--tokenizer.path", str(vocab_tokenizer(folder, QWEN3_VOCAB))]
    precision = "float32" if opts.device == "cpu" else "bfloat16"
    responses, prompt_room = 8 * opts.prompts, opts.seq_len - opts.max_new_tokens
    return [
        "--job.config_file", "train_configs/debug_grpo.toml", *model, *tokenizer,
        "--checkpoint.no_enable", "--checkpoint.initial_load_path", "", "--eval.interval", "0",
        "--training.steps", str(opts.steps), "--training.local_batch_size", str(min(8, responses)),
        "--training.global_batch_size", str(responses), "--training.seq_len", str(opts.seq_len),
        "--training.mixed_precision_param", precision,
        "--rl.max_new_tokens", str(opts.max_new_tokens), "--rl.max_prompt_len", str(prompt_room),
        "--rl.temperature", "1.0", "--grpo.old_logprobs", "recompute", "--grpo.beta", "0.04",
        "--rollout.engine", "titanium", "--metrics.log_freq", "1", "--debug.seed", "0",
    ]  # fmt: skip


def table(results: dict[str, dict[str, float] | str], opts: argparse.Namespace) -> str:
    shape = "Qwen3's debug flavor (smoke run)" if opts.smoke else "Qwen3 1.7B shape, random weights"
    lines = [
        "# GRPO on one device: generation, weight sync, reference and training" + (" (smoke run)" * opts.smoke),
        "",
        f"Command: `{command_line()}`. {environment(torch.device(opts.device))}",
        "",
        f"{shape}; {opts.prompts} prompts x 8 responses per step, up to {opts.max_new_tokens} new tokens, rows of "
        f"{opts.seq_len} tokens, a rollout batch every step, old log-probs recomputed, KL reference (beta 0.04), "
        f"titanium's engine. Seconds per step (generated tok/s, peak GiB), means of steps 2-{opts.steps} "
        "(the script's docstring says what each column is).",
        "",
        "| variant | generate s | generated tok/s | waited s | old log-probs s | reference s | sync s | train s "
        "| step s | peak GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    digits = {"tps": ",.0f", "memory": ".1f"}
    lines += table_rows(results, lambda r: [number(r[c], digits.get(c, ".3f")) for c in COLUMNS], len(COLUMNS) + 1)
    return "\n".join(lines) + "\n"


def run(opts: argparse.Namespace) -> str:
    """Every chosen variant's run, and the results table (rewritten after each, for a suite's time limit)."""
    results: dict[str, dict[str, float] | str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        job = flags(opts, Path(tmp))
        for name in opts.variants:
            cpu = opts.device == "cpu"
            results[name] = attempt(
                [*job, *VARIANTS[name]], Path(tmp) / name, timeout=opts.run_timeout, cpu=cpu, tags=TAGS
            )
            write(table(results, opts), opts.out, echo=False)
    return table(results, opts)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--smoke", action="store_true", help="Qwen3's debug flavor, 3 steps of 8-token responses (CPU)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (8 responses each)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=512, help="training rows: prompt room is this - max new tokens")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--run-timeout", type=float, default=300, help="seconds per variant before it is given up")
    p.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    return p


def main() -> None:
    opts = parser().parse_args()
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here; --device cpu --smoke runs the CPU check")
    if opts.smoke:  # (compiling decoding on a small CPU takes minutes)
        opts.variants = [v for v in opts.variants if v != "compiled"]
        opts.prompts, opts.max_new_tokens, opts.seq_len, opts.steps = 1, 8, 64, 3
    write(run(opts), opts.out)


if __name__ == "__main__":
    main()
