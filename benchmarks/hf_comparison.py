"""Titanium SFT beside Hugging Face transformers' ``Trainer`` and TRL's ``SFTTrainer``: same model, same data in the
same order, same optimizer, LR schedule, batch and steps; tokens/s and held-out accuracy.

- Model: the debug Llama (6 blocks, dim 256, the debug tokenizer's 2,256 ids) with seeded random weights, written
  as a Hugging Face folder that all three load (titanium with ``--checkpoint.initial_load_in_hf``, the others with
  ``from_pretrained``), in float32.
- Data: the first ``steps x batch`` conversations of the bundled arithmetic tasks, tokenized once by titanium's
  Llama 3 chat template; only the assistant's tokens are learned. Titanium reads the file itself, in order, one
  conversation per row (``--sft.no_packing``, rows padded to the longest conversation); Trainer and SFTTrainer get
  the same token ids and loss masks, in order (a sequential sampler), padded to each batch's longest.
- Optimizer: fused AdamW, lr 1e-3, betas (0.9, 0.95), eps 1e-8, no weight decay, gradient clipping at 1.0,
  10 warmup steps then cosine decay to 0.1 x lr; batch 8; no gradient accumulation.
- Tokens/s: the conversations' tokens (no padding) of steps 2..N over the wall time between the end of step 1
  and the end of step N (titanium: the wall times of its TensorBoard events for steps 1 and N; the others: a
  callback at each step's end), in ``--rounds`` short runs per trainer, the three taking turns (the machine's
  load changes over minutes), median. All log every 10 steps.
- Held-out: the final weights of one ``--steps`` run per trainer are exported as a Hugging Face folder and scored
  by one piece of code on the first ``--eval-samples`` rows of the held-out file: exact match of greedy answers
  (titanium's evaluator) and the mean cross-entropy of the answer tokens (teacher forcing, transformers' model).

    python benchmarks/hf_comparison.py --out benchmarks/results/hf_comparison_cpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import REPO, command_line, environment, train, write  # noqa: E402
from generation import debug_folder  # noqa: E402

from titanium.config.sections import DataSection, EvalSection  # noqa: E402
from titanium.data.chat import Llama3Template, parse_chat_row  # noqa: E402
from titanium.data.tokenizer import DEFAULT_TOKENIZER_PATH, TiktokenTokenizer  # noqa: E402

TRAIN, TEST = "assets/tasks/arithmetic/train.jsonl", "assets/tasks/arithmetic/test.jsonl"
BATCH, LR, WARMUP, MIN_LR_FACTOR, BETAS, EPS, MAX_NORM = 8, 1e-3, 10, 0.1, (0.9, 0.95), 1e-8, 1.0
LOG_FREQ = 10


def conversations(path: str, n: int, template: Llama3Template) -> list[tuple[list[int], list[bool]]]:
    """The first ``n`` rows as (token ids, learned mask), tokenized as titanium's SFT data does."""
    with open(REPO / path) as f:
        rows = [json.loads(line) for line, _ in zip(f, range(n))]
    return [template.tokenize(parse_chat_row(row, DataSection(kind="chat")), train_on_input=False) for row in rows]


def run_titanium(model: Path, out: Path, steps: int, seq_len: int, threads: int) -> tuple[float, Path]:
    """Seconds from the end of step 1 to the end of the last step of a ``python -m titanium.train`` SFT run, and
    its exported Hugging Face folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    flags = [
        "--job.config_file", "train_configs/debug_sft.toml",
        "--checkpoint.initial_load_path", str(model), "--checkpoint.initial_load_in_hf",
        "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only", "--checkpoint.interval", str(steps),
        "--training.steps", str(steps), "--training.seq_len", str(seq_len), "--training.local_batch_size", str(BATCH),
        "--training.mixed_precision_param", "float32", "--training.max_norm", str(MAX_NORM),
        "--optimizer.lr", str(LR), "--optimizer.weight_decay", "0", "--optimizer.beta1", str(BETAS[0]),
        "--optimizer.beta2", str(BETAS[1]), "--optimizer.eps", str(EPS),
        "--lr_scheduler.warmup_steps", str(WARMUP), "--lr_scheduler.decay_type", "cosine",
        "--lr_scheduler.min_lr_factor", str(MIN_LR_FACTOR),
        "--sft.no_packing", "--eval.interval", "0", "--metrics.log_freq", str(LOG_FREQ),
    ]  # fmt: skip
    os.environ["OMP_NUM_THREADS"] = str(threads)
    train(flags, out)
    acc = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    logged = {e.step: e.wall_time for e in acc.Scalars("loss_metrics/global_avg_loss")}  # written after each step
    return logged[steps] - logged[1], out / "hf"


class StepClock(transformers.TrainerCallback):
    """The wall time at the end of each optimizer step."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())


def hf_arguments(cls, folder: Path, steps: int, **extra):
    """The Trainer / SFTConfig arguments that make the same optimizer, schedule and batch as titanium's run."""
    return cls(
        output_dir=str(folder),
        max_steps=steps,
        per_device_train_batch_size=BATCH,
        learning_rate=LR,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_epsilon=EPS,
        weight_decay=0.0,
        max_grad_norm=MAX_NORM,
        optim="adamw_torch_fused",
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": MIN_LR_FACTOR},
        warmup_steps=WARMUP,
        logging_steps=LOG_FREQ,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
        **extra,
    )


def in_order(trainer_cls):
    """``trainer_cls`` reading its data in order (as titanium reads the file), so all runs see the same batches."""

    class InOrder(trainer_cls):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    return InOrder


def word_tokenizer(tokenizer: TiktokenTokenizer):
    """A transformers tokenizer with the debug tokenizer's ids (for padding and the end token only: the data
    comes already tokenized)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(tokenizer.vocab_size)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="t0")),
        pad_token=f"t{tokenizer.pad_id}",
        eos_token=f"t{tokenizer.eos_id}",
    )


def run_hf(model: Path, out: Path, steps: int, data: list, tokenizer, trl: bool) -> tuple[float, Path]:
    """Seconds from the end of step 1 to the end of the last step of transformers' Trainer or TRL's SFTTrainer on
    the same token ids, and the saved model."""
    import datasets

    net = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    clock = StepClock()
    if trl:
        from trl import SFTConfig, SFTTrainer

        rows = {"input_ids": [t for t, _ in data], "completion_mask": [[int(m) for m in mask] for _, mask in data]}
        args = hf_arguments(SFTConfig, out, steps, max_length=None, packing=False, completion_only_loss=True)
        trainer = in_order(SFTTrainer)(
            model=net,
            args=args,
            train_dataset=datasets.Dataset.from_dict(rows),
            processing_class=tokenizer,
            callbacks=[clock],
        )
    else:
        rows = {
            "input_ids": [t for t, _ in data],
            "labels": [[t if m else -100 for t, m in zip(ids, mask)] for ids, mask in data],
        }
        trainer = in_order(transformers.Trainer)(
            model=net,
            args=hf_arguments(transformers.TrainingArguments, out, steps),
            train_dataset=datasets.Dataset.from_dict(rows),
            data_collator=transformers.DataCollatorForSeq2Seq(tokenizer, padding=True),
            callbacks=[clock],
        )
    trainer.train()
    trainer.save_model(str(out / "hf"))
    return clock.ends[-1] - clock.ends[0], out / "hf"


def held_out(folder: Path, template: Llama3Template, tokenizer: TiktokenTokenizer, n: int) -> tuple[float, float]:
    """(exact match of greedy answers, mean answer-token cross-entropy) of the model in ``folder``."""
    from titanium.evaluation.exact_match import ExactMatchEvaluator
    from titanium.model_builder import ModelBuilder
    from titanium.models import get_model_spec

    ours = ModelBuilder(torch.device("cpu")).load_hf(get_model_spec("llama3"), folder).model
    eval_cfg = EvalSection(path=TEST, max_samples=n)
    evaluator = ExactMatchEvaluator(eval_cfg, DataSection(kind="chat"), template, tokenizer)
    exact = evaluator(ours)["eval/exact_match"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, mask in conversations(TEST, n, template):
            labels = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
            loss = hf(input_ids=torch.tensor([ids]), labels=labels[None]).loss
            learned = int((labels[1:] != -100).sum())
            total, count = total + loss.item() * learned, count + learned
    return exact, total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="steps of the runs that are scored")
    parser.add_argument("--speed-steps", type=int, default=40, help="steps of each timed run")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of each trainer, taking turns")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of every run")
    parser.add_argument("--eval-samples", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    tokenizer = TiktokenTokenizer(str(REPO / DEFAULT_TOKENIZER_PATH))
    template = Llama3Template(tokenizer)
    data = conversations(TRAIN, max(opts.steps, opts.speed_steps) * BATCH, template)
    seq_len = max(len(ids) for ids, _ in data)
    timed_tokens = sum(len(ids) for ids, _ in data[BATCH : opts.speed_steps * BATCH])  # steps 2..N
    speed: dict[str, list[float]] = {}
    scores = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = debug_folder(Path(tmp) / "start")

        def run(name: str, out: Path, steps: int) -> tuple[float, Path]:
            if name == "titanium":
                return run_titanium(model, out, steps, seq_len, opts.threads)
            trl = name.startswith("TRL")
            return run_hf(model, out, steps, data[: steps * BATCH], word_tokenizer(tokenizer), trl=trl)

        names = ["titanium", "transformers Trainer", "TRL SFTTrainer"]
        for r in range(opts.rounds):  # the trainers take turns, so a change in the machine's load hits all alike
            for name in names:
                seconds, _ = run(name, Path(tmp) / f"{name.split()[0]}-speed{r}", opts.speed_steps)
                speed.setdefault(name, []).append(timed_tokens / seconds)
        for name in names:
            _, folder = run(name, Path(tmp) / name.split()[0], opts.steps)
            scores[name] = held_out(folder, template, tokenizer, opts.eval_samples)
    import trl

    lines = [
        "# SFT on CPU: titanium vs transformers Trainer vs TRL SFTTrainer",
        "",
        f"Command: `{command_line()}`. {environment(torch.device('cpu'))} transformers {transformers.__version__},"
        f" trl {trl.__version__}; {opts.threads} thread(s) per run.",
        "",
        f"Debug Llama (6 blocks, dim 256, 2,256 ids), float32, same seeded start; arithmetic conversations in file "
        f"order, {BATCH} per step; fused AdamW lr {LR}, betas {BETAS}, no weight decay, clip {MAX_NORM}, {WARMUP} "
        f"warmup steps, cosine to {MIN_LR_FACTOR} x lr; log every {LOG_FREQ} steps. Tokens/s: {opts.rounds} runs of "
        f"{opts.speed_steps} steps per trainer, the trainers taking turns; each run's {timed_tokens:,} conversation "
        f"tokens of steps 2-{opts.speed_steps} (no padding) over their wall time; the median (lowest-highest). "
        f"Held-out: after {opts.steps} steps ({opts.steps * BATCH} conversations), the first {opts.eval_samples} "
        f"rows of `{TEST}`, scored by the same code for all three.",
        "",
        "| trainer | tokens/s | held-out exact match | held-out answer loss |",
        "|---|---:|---:|---:|",
    ]
    for name in names:
        tps, (exact, loss) = speed[name], scores[name]
        spread = f"{statistics.median(tps):,.0f} ({min(tps):,.0f}-{max(tps):,.0f})"
        lines.append(f"| {name} | {spread} | {exact:.1%} | {loss:.4f} |")
    write("\n".join(lines) + "\n", opts.out)


if __name__ == "__main__":
    main()
