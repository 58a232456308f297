"""GRPO with microbatches narrowed to the columns they use (``--rl.pad_to longest``, the default without pipeline
parallelism) against every microbatch as wide as its rollout batch (``seq_len``): seconds per step of the parts
the width changes, on the same rollouts.

    python benchmarks/grpo_padding.py --out benchmarks/results/grpo_padding_cpu.md
    python benchmarks/grpo_padding.py --repeats 2 --out ""                            # a quick look, no file

The debug model (llama3 ``debugmodel``, random weights: speed does not depend on them) and the real objective
(titanium/objectives/grpo.py) in this process, prompts of the bundled arithmetic tasks in the llama3 template, one
prompt's group of ``--group`` responses per microbatch, ``--prompts`` microbatches per step, a KL-penalized
reference (beta 0.05) and old log-probs recomputed by the policy. Sampling is replaced by responses fixed in
advance, so both layouts train on the very same rows and generation costs nothing here: response lengths are
drawn from a log-normal distribution (median ``--median`` tokens, sigma ``--sigma``), those reaching
``--max_new_tokens`` are cut there (truncated), the others end with a stop id. Timed per step: the reference
forward and the old log-prob forward (``grpo/time/reference``, ``grpo/time/old_logprobs``) and the forward and
backward of every microbatch; each repeat runs both layouts in turn (the machine may be shared: alternating
spreads its load over both), and the table shows medians over the repeats.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]  # this checkout's titanium and tests, then the shared helpers
from bench_common import cpu_header, write  # noqa: E402

from tests.helpers import LocalModels  # noqa: E402
from titanium.config.sections import ChatSection, DataSection, GRPOSection, RLSection  # noqa: E402
from titanium.data.prompts import PromptSample  # noqa: E402
from titanium.data.tokenizer import DEFAULT_TOKENIZER_PATH, TiktokenTokenizer  # noqa: E402
from titanium.generation.generate import Generation  # noqa: E402
from titanium.models.llama3 import LLAMA3_FLAVORS, Transformer  # noqa: E402
from titanium.objectives.base import ModelOutput, ObjectiveContext  # noqa: E402
from titanium.objectives.grpo import GRPOObjective  # noqa: E402
from titanium.rl.rollout import Rollout, to_rollout  # noqa: E402
from titanium.rl.source import RolloutSource  # noqa: E402

LAYOUTS = ("seq_len", "longest")


def fixed_sampler(median: float, sigma: float):
    """``RolloutSource.sample`` with responses fixed in advance: log-normal lengths, the same for a given batch."""

    def sample(self: RolloutSource, samples: list[PromptSample], index: int) -> tuple[Rollout, int]:
        width, stop = self.cfg.max_new_tokens, min(self.engine.stop_ids)
        g = torch.Generator().manual_seed(index)
        rows = len(samples) * self.draw.group_size
        lengths = (torch.randn(rows, generator=g) * sigma + torch.tensor(median).log()).exp().ceil().long()
        lengths = lengths.clamp(1, width)
        tokens = torch.randint(200, 2000, (rows, width), generator=g)
        finished = lengths < width
        for row, (n, done) in enumerate(zip(lengths.tolist(), finished.tolist())):
            if done:
                tokens[row, n - 1] = stop
            tokens[row, n:] = self.tokenizer.pad_id
        out = Generation(tokens=tokens, logprobs=torch.zeros(rows, width), lengths=lengths, finished=finished)
        return to_rollout(
            samples, self.draw.group_size, out, self.rewards, self.tokenizer
        ), self.engine.synced_version()

    return sample


def one_step(model: Transformer, tokenizer: TiktokenTokenizer, pad_to: str, args: argparse.Namespace) -> dict:
    """One step's timed parts under ``pad_to``, and the microbatches' widths."""
    reference = copy.deepcopy(model).requires_grad_(False)
    models = LocalModels(lambda: reference, policy=model, policy_args=model.args)
    chat = ChatSection("llama3")
    ctx = ObjectiveContext(
        tokenizer, "llama3", "llama3", tokenizer.vocab_size, args.seq_len, args.group, 0, 1, 0, models=models, chat=chat
    )
    cfg = GRPOSection(group_size=args.group, beta=0.05, old_logprobs="recompute")
    rl = RLSection(max_new_tokens=args.max_new_tokens, max_prompt_len=args.seq_len - args.max_new_tokens, pad_to=pad_to)
    tasks = DataSection(kind="chat", path=str(REPO / "assets/tasks/arithmetic/train.jsonl"))
    objective = GRPOObjective(ctx, tasks, cfg, rl)
    prepared = objective.prepare([objective.next_microbatch() for _ in range(args.prompts)])
    model.zero_grad()
    start = time.perf_counter()
    for batch in prepared.batches:
        logits = model(**batch.model_inputs())
        objective.loss(ModelOutput(logits=logits), batch).loss_sum.backward()
    train = time.perf_counter() - start
    objective.close()
    seconds = {part: prepared.metrics[f"grpo/time/{part}"][0].item() for part in ("reference", "old_logprobs")}
    widths = [batch.tokens.shape[1] for batch in prepared.batches]
    return {**seconds, "train": train, "total": train + sum(seconds.values()), "width": statistics.mean(widths)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="microbatches per step (one prompt's group each)")
    parser.add_argument("--group", type=int, default=8, help="responses per prompt (rows per microbatch)")
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--median", type=float, default=48, help="median response length (tokens)")
    parser.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of the response lengths")
    parser.add_argument("--repeats", type=int, default=5, help="steps per layout, in turn")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/grpo_padding_cpu.md"), help='"": no file')
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    RolloutSource.sample = fixed_sampler(args.median, args.sigma)
    tokenizer = TiktokenTokenizer(str(REPO / DEFAULT_TOKENIZER_PATH))
    flavor = dataclasses.replace(
        LLAMA3_FLAVORS["debugmodel"], vocab_size=tokenizer.vocab_size, max_seq_len=args.seq_len
    )
    model = Transformer(flavor)
    model.init_weights(seed=0)
    one_step(model, tokenizer, "longest", args)  # (warm-up)
    runs: dict[str, list[dict]] = {pad_to: [] for pad_to in LAYOUTS}
    for _ in range(args.repeats):
        for pad_to in LAYOUTS:
            runs[pad_to].append(one_step(model, tokenizer, pad_to, args))
    medians = {pad_to: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for pad_to, rs in runs.items()}
    ratios = [a["total"] / b["total"] for a, b in zip(runs["seq_len"], runs["longest"])]
    lines = [
        *cpu_header("GRPO microbatch widths: narrowed to the columns used vs the rollout batch's width", args.threads),
        "",
        f"llama3 debugmodel, {args.prompts} prompts x {args.group} responses per step (one prompt's group per "
        f"microbatch), responses fixed in advance: log-normal lengths (median {args.median:g}, sigma {args.sigma:g}) "
        f"capped at {args.max_new_tokens}. Seconds per step, medians over {args.repeats} steps of each layout, in "
        "turn (script docstring).",
        "",
        "| --rl.pad_to | mean width | reference (s) | old log-probs (s) | forward + backward (s) | total (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for pad_to, m in medians.items():
        lines.append(
            f"| {pad_to} | {m['width']:.0f} | {m['reference']:.3f} | {m['old_logprobs']:.3f} | {m['train']:.3f} | "
            f"{m['total']:.3f} |"
        )
    lines += [
        "",
        "Total time, seq_len / longest, per repeat: "
        + ", ".join(f"{x:.2f}x" for x in ratios)
        + f" (median {statistics.median(ratios):.2f}x).",
    ]
    write("\n".join(lines) + "\n", Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
