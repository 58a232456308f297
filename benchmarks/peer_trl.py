"""TRL 1.16's GRPOTrainer and DPOTrainer on the token ids titanium trains on, for ``benchmarks/peers.py``.

    python benchmarks/peer_trl.py grpo --model <hf folder> --data <prompts.json> --out steps.jsonl [...]
    python benchmarks/peer_trl.py dpo  --model <hf folder> --data <pairs.json> --out steps.jsonl [...]

The data is titanium's tokenization (its chat template and tokenizer), written by ``peers.py`` as words ``t<id>``:
the tokenizer here has one word per id (a whitespace-split word-level vocabulary), so TRL's own tokenization gives
back exactly titanium's ids, read in titanium's order. Each optimizer step appends a JSON line: the step, the time
it ended, the seconds it took and what the trainer logged for it (loss; GRPO: the completions' mean length).
Generation is transformers' ``generate`` inside the trainer (vLLM, TRL's fast path, is not among the GPU machine's
wheels).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from hf_comparison import in_order  # (the pairs in file order, as titanium reads them)


def word_tokenizer(vocab: int, pad_id: int, eos_id: int):
    """One word ``t<id>`` per id, split on whitespace: a text of such words tokenizes to those ids, nothing added."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token=f"t{pad_id}", eos_token=f"t{eos_id}")


def words(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def step_log():
    """A TrainerCallback writing one JSON line per optimizer step (what the trainer logged at it, and its time)."""
    from transformers import TrainerCallback

    class StepLog(TrainerCallback):
        def __init__(self) -> None:
            self.path, self.start, self.rows = None, 0.0, {}

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            end = time.perf_counter()
            self.rows[state.global_step] = {"step": state.global_step, "time": end, "seconds": end - self.start}

        def on_log(self, args, state, control, logs=None, **kwargs):
            row = self.rows.setdefault(state.global_step, {"step": state.global_step})
            row.update({k: float(v) for k, v in (logs or {}).items() if isinstance(v, int | float)})
            if torch.cuda.is_available():
                row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
                torch.cuda.reset_peak_memory_stats()
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")

    return StepLog()


def common(opts: argparse.Namespace) -> dict:
    """What both trainers get alike: the step count and batch, the optimizer (AdamW at a constant lr, no weight
    decay, clipping at 1), bf16 autocast on a GPU (float32 weights, as titanium), no gradient checkpointing (the
    TRL configs' default is on), every step logged, nothing saved."""
    cuda = torch.cuda.is_available()
    return dict(
        output_dir=tempfile.mkdtemp(), report_to=[], max_steps=opts.steps, logging_steps=1, save_strategy="no",
        learning_rate=opts.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        bf16=cuda, use_cpu=not cuda, gradient_checkpointing=False, seed=0, dataloader_num_workers=0,
        per_device_train_batch_size=opts.batch, gradient_accumulation_steps=opts.accumulation,
    )  # fmt: skip


def grpo(opts: argparse.Namespace, tokenizer, model) -> None:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    prompts = [words(p) for p in json.loads(Path(opts.data).read_text())]

    def no_reward(completions, **kwargs) -> list[float]:  # (titanium's exact match of a random model: all 0)
        return [0.0] * len(completions)

    config = GRPOConfig(
        **common(opts), num_generations=opts.group, max_completion_length=opts.max_new_tokens,
        temperature=1.0, beta=opts.beta, loss_type="dapo", scale_rewards="group", epsilon=0.2,
        shuffle_dataset=False,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, reward_funcs=no_reward, args=config, processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
    )  # fmt: skip
    run(trainer, opts)


def dpo(opts: argparse.Namespace, tokenizer, model) -> None:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    pairs = json.loads(Path(opts.data).read_text())
    columns = {key: [words(p[key]) for p in pairs] for key in ("prompt", "chosen", "rejected")}
    config = DPOConfig(**common(opts), beta=0.1, loss_type=["sigmoid"], max_length=opts.max_length)
    trainer = in_order(DPOTrainer)(
        model=model, args=config, processing_class=tokenizer, train_dataset=Dataset.from_dict(columns)
    )
    run(trainer, opts)


def run(trainer, opts: argparse.Namespace) -> None:
    log = step_log()
    log.path = opts.out
    trainer.add_callback(log)
    trainer.train()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("objective", choices=["grpo", "dpo"])
    parser.add_argument("--model", required=True, help="Hugging Face folder (the weights titanium loads too)")
    parser.add_argument("--data", required=True, help="JSON: prompts (lists of ids) or pairs (prompt/chosen/rejected)")
    parser.add_argument("--out", required=True, help="JSON lines, one per step")
    parser.add_argument("--pad-id", type=int, required=True)
    parser.add_argument("--eos-id", type=int, required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="sequences (GRPO) or pairs (DPO) per microbatch")
    parser.add_argument("--accumulation", type=int, default=1, help="microbatches per step")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--group", type=int, default=8, help="GRPO: responses per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--beta", type=float, default=0.04, help="GRPO: KL weight (a reference model when > 0)")
    parser.add_argument("--max-length", type=int, default=2048, help="DPO: longest prompt + response")
    opts = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(opts.model, dtype=torch.float32)
    tokenizer = word_tokenizer(model.config.vocab_size, opts.pad_id, opts.eos_id)
    (grpo if opts.objective == "grpo" else dpo)(opts, tokenizer, model)


if __name__ == "__main__":
    main()
