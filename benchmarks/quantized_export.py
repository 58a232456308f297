"""Quantized export for serving, measured on the debug task: file size, logit error and held-out exact match of
each scheme this machine can run.

Starts from a trained model's Hugging Face folder (the SFT debug flow of docs/post_training.md, exported with
``--checkpoint.last_save_in_hf``), writes each scheme's folder with the code behind
``python -m titanium.tools.convert quantize``, and measures the folders as a server would use them, loaded by
``transformers``:

- size: bytes of ``model.safetensors``;
- logit error: max and mean ``|logit - float32 logit|`` over every position of the held-out rows (prompt and
  reference answer, teacher-forced);
- exact match: greedy answers (``generate``, at most 16 new tokens, stopping at the chat template's end of turn)
  to the first ``--max-samples`` held-out prompts, scored as titanium's evaluator scores them
  (``decoded.strip() == reference.strip()``).

    ./run_train.sh && CONFIG_FILE=train_configs/debug_sft.toml ./run_train.sh --checkpoint.last_save_in_hf
    python benchmarks/quantized_export.py --hf outputs/debug_sft/hf --out benchmarks/results/quantized_export_cpu.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]  # this checkout's titanium, and bench_common

from bench_common import command_line, environment, write  # noqa: E402

from titanium.checkpoint.hf import EXPORT_DTYPES, SINGLE_FILE, HFCheckpoint, save_hf_weights  # noqa: E402
from titanium.checkpoint.quantized_export import export_quantized_hf  # noqa: E402
from titanium.config.sections import DataSection, EvalSection, TokenizerSection  # noqa: E402
from titanium.data.chat import build_chat_template  # noqa: E402
from titanium.data.tokenizer import build_tokenizer  # noqa: E402
from titanium.evaluation.exact_match import EvalSample, load_eval_samples  # noqa: E402
from titanium.models import default_chat_format, get_model_spec  # noqa: E402
from titanium.quantize.schemes import SCHEMES  # noqa: E402


def dense_copy(source: Path, out: Path, model: str, dtype: str) -> Path:
    """The source folder's weights in ``dtype`` (the unquantized baseline a quantized folder is compared with)."""
    spec = get_model_spec(model)
    ckpt = HFCheckpoint.open(source)
    args = spec.hf_adapter.from_hf_config(ckpt.config)
    state = spec.hf_adapter.from_hf(ckpt.read(), args)
    return save_hf_weights(state, out, spec.hf_adapter, args, dtype=EXPORT_DTYPES[dtype], source=ckpt)


def _batches(rows: list[list[int]], size: int, pad_id: int, left: bool):
    """(ids, attention mask, lengths) for each batch of ``rows``, padded on the left or the right."""
    for start in range(0, len(rows), size):
        chunk = rows[start : start + size]
        width = max(map(len, chunk))
        pads = [[pad_id] * (width - len(r)) for r in chunk]
        ids = [p + r if left else r + p for r, p in zip(chunk, pads, strict=True)]
        mask = [[0] * len(p) + [1] * len(r) if left else [1] * len(r) + [0] * len(p) for r, p in zip(chunk, pads)]
        yield torch.tensor(ids), torch.tensor(mask), [len(r) for r in chunk]


@torch.no_grad()
def measure(folder: Path, samples: list[EvalSample], answers: list[list[int]], tokenizer, stop_ids: set[int]):
    """(teacher-forced logits of each held-out row, exact match) of the folder loaded by transformers."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    rows = [s.prompt + a for s, a in zip(samples, answers, strict=True)]
    logits = []
    for ids, mask, lengths in _batches(rows, 32, tokenizer.pad_id, left=False):
        out = model(input_ids=ids, attention_mask=mask).logits.float()
        logits += [out[i, :n] for i, n in enumerate(lengths)]
    generated = []
    for ids, mask, _ in _batches([s.prompt for s in samples], 32, tokenizer.pad_id, left=True):
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=sorted(stop_ids),
            pad_token_id=tokenizer.pad_id,
        )
        generated += out[:, ids.shape[1] :].tolist()
    correct = 0
    for sample, out in zip(samples, generated, strict=True):
        ends = [i for i, t in enumerate(out) if t in stop_ids or t == tokenizer.pad_id]
        correct += tokenizer.decode(out[: ends[0]] if ends else out).strip() == sample.reference.strip()
    return logits, correct / len(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf", type=Path, required=True, help="the trained model's HF folder (float32)")
    parser.add_argument("--model", default="llama3")
    parser.add_argument("--tokenizer", default="assets/tokenizer/titanium_debug.tiktoken")
    parser.add_argument("--chat-template", default="llama3")
    parser.add_argument("--eval-path", default="assets/tasks/arithmetic/test.jsonl")
    parser.add_argument("--max-samples", type=int, default=128, help="held-out rows (default 128, as debug_sft)")
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--out", type=Path, help="results file (markdown)")
    args = parser.parse_args()
    tokenizer = build_tokenizer(TokenizerSection(kind="tiktoken", path=args.tokenizer))
    template = build_chat_template(args.chat_template, tokenizer, default_chat_format(args.model))
    cfg = EvalSection(path=args.eval_path, max_samples=args.max_samples)
    samples = load_eval_samples(cfg, DataSection(kind="chat"), template, tokenizer)
    answers = [tokenizer.encode(s.reference, bos=False, eos=False) for s in samples]
    runnable = [name for name, scheme in SCHEMES.items() if scheme.cuda_capability is None or torch.cuda.is_available()]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folders = {
            "none (float32)": args.hf,
            "none (bfloat16)": dense_copy(args.hf, Path(tmp) / "bf16", args.model, "bfloat16"),
        }
        for name in runnable:
            folders[name] = export_quantized_hf(
                args.hf, Path(tmp) / name, args.model, name, group_size=args.group_size, dtype=torch.bfloat16
            )
        reference = None
        for name, folder in folders.items():
            logits, match = measure(folder, samples, answers, tokenizer, template.stop_ids)
            reference = reference or logits
            diffs = [(a - b).abs() for a, b in zip(logits, reference, strict=True)]
            max_err, mean_err = max(d.max().item() for d in diffs), torch.cat(diffs).mean().item()
            rows.append((name, (folder / SINGLE_FILE).stat().st_size, max_err, mean_err, match))
            print(*rows[-1], flush=True)
    table = [
        "| scheme | model.safetensors | max abs logit error | mean abs logit error | exact match |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, size, max_err, mean_err, match in rows:
        table.append(f"| {name} | {size / 2**20:.2f} MiB | {max_err:.3f} | {mean_err:.4f} | {match:.1%} |")
    skipped = [name for name in SCHEMES if name not in runnable]
    text = "\n".join(
        [
            "# Quantized export for serving: the debug SFT model",
            "",
            environment(torch.device("cpu")) + f" Command: `{command_line()}`.",
            f"{len(samples)} held-out rows of {args.eval_path}; group size {args.group_size}; every quantized folder "
            "keeps its embedding, norms and output layer in bfloat16. Logit errors are against the float32 model.",
            "",
            *table,
            "",
            f"Not measured (no CUDA GPU here): {', '.join(skipped)}." if skipped else "",
        ]
    )
    write(text.rstrip() + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
