"""lm-eval requests per second: titanium's LM (titanium/evaluation/lm.py) against lm-eval's own ``HFLM``, same model,
same requests, same batch size, one process.

The model is a random Llama written as a Hugging Face folder with transformers (tests/lm_eval/tiny_model.py, its
byte-level BPE tokenizer trained on the bundled questions; ``--hidden`` and ``--layers`` set its size), read by both.
The requests are what the bundled tasks send (assets/tasks/arithmetic/lm_eval): ``arithmetic_mc``'s log-likelihoods
(each question with each of its choices) and ``arithmetic_gen``'s greedy generations (until a newline, at most 16
tokens). Requests/s = requests / seconds, the median of ``--repeats`` timed runs after a warm-up, the two taking turns.
Each run also reports the largest log-likelihood difference and how many generations are equal (float32: all).

    python benchmarks/lm_eval_speed.py --threads 1 --out benchmarks/results/lm_eval_speed_cpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.lm_eval.tiny_model import make_tiny_hf  # noqa: E402

TASKS = REPO / "assets/tasks/arithmetic"


def instances(kind: str, arguments: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, args, i, ("bench", i, 1)) for i, args in enumerate(arguments)]


def requests(mc: int, gen: int) -> tuple[list, list]:
    rows = [json.loads(line) for line in (TASKS / "lm_eval/arithmetic_mc.jsonl").read_text().splitlines()[:mc]]
    pairs = [(row["question"], f" {choice}") for row in rows for choice in row["choices"]]
    questions = [json.loads(line) for line in (TASKS / "test.jsonl").read_text().splitlines()[:gen]]
    until = {"until": ["\n"], "max_gen_toks": 16}
    prompts = [(row["messages"][0]["content"], until) for row in questions]
    return instances("loglikelihood", pairs), instances("generate_until", prompts)


def build(folder: Path, batch_size: int) -> tuple:
    from lm_eval.models.huggingface import HFLM

    from titanium.data.tokenizer import HFTokenizer
    from titanium.evaluation.lm import TitaniumLM
    from titanium.model_builder import ModelBuilder
    from titanium.models import get_model_spec

    model = ModelBuilder(torch.device("cpu")).load_hf(get_model_spec("llama3"), folder).model.eval()
    tokenizer = HFTokenizer(str(folder / "tokenizer.json"))
    ours = TitaniumLM(model, tokenizer, max_length=model.args.max_seq_len, batch_size=batch_size)
    theirs = HFLM(pretrained=str(folder), device="cpu", batch_size=batch_size, dtype="float32")
    return ours, theirs


def timed(fn, reqs) -> tuple[float, list]:
    start = time.perf_counter()
    out = fn(reqs, disable_tqdm=True)
    return time.perf_counter() - start, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--mc", type=int, default=100, help="multiple-choice questions (each 2-4 requests)")
    p.add_argument("--gen", type=int, default=32, help="generation requests")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    folder = make_tiny_hf(Path(tempfile.mkdtemp()) / "model", hidden_size=args.hidden, layers=args.layers)
    ours, theirs = build(folder, args.batch_size)
    loglikelihood, generation = requests(args.mc, args.gen)
    rows = []
    for kind, reqs in (("loglikelihood", loglikelihood), ("generate_until", generation)):
        times: dict[str, list[float]] = {"titanium": [], "HFLM": []}
        outputs = {}
        for repeat in range(args.repeats + 1):  # (the first round warms up)
            for name, lm in (("titanium", ours), ("HFLM", theirs)):
                seconds, outputs[name] = timed(getattr(lm, kind), reqs)
                if repeat:
                    times[name].append(seconds)
        if kind == "loglikelihood":
            diff = max(abs(a[0] - b[0]) for a, b in zip(outputs["titanium"], outputs["HFLM"]))
            agree = f"max log-likelihood difference {diff:.1e}"
        else:
            same = sum(a == b for a, b in zip(outputs["titanium"], outputs["HFLM"]))
            agree = f"{same}/{len(reqs)} generations equal"
        speed = {name: len(reqs) / statistics.median(t) for name, t in times.items()}
        rows.append((kind, len(reqs), speed["titanium"], speed["HFLM"], agree))

    load = os.getloadavg()[1]
    import lm_eval
    import transformers

    lines = [
        "# lm-eval requests/s: titanium's LM vs lm-eval's HFLM",
        "",
        f"Device: CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, 5-minute load {load:.1f}; "
        f"{args.threads} threads), float32; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"lm-eval {lm_eval.__version__}, Python {platform.python_version()}.",
        f"Model: random Llama, hidden {args.hidden}, {args.layers} layers, vocabulary 304, from a Hugging Face folder "
        f"both read; batch size {args.batch_size}; median of {args.repeats} runs after a warm-up, taking turns.",
        f"Command: `python {' '.join(sys.argv)}`",
        "",
        "| requests | count | titanium req/s | HFLM req/s | titanium / HFLM | agreement |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for kind, count, a, b, agree in rows:
        lines.append(f"| {kind} | {count} | {a:,.1f} | {b:,.1f} | {a / b:.2f}x | {agree} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
