"""Generation throughput: titanium's sampler against Hugging Face ``generate``, same model, same batch.

The model is the debug Llama (random weights from a seed, the debug tokenizer's vocabulary) written as
a Hugging Face folder by titanium's exporter, or any Llama / Qwen3 folder given with ``--hf-folder``;
titanium loads it with ``ModelBuilder.load_hf``, transformers with ``from_pretrained``. Every prompt
has the same length (no padding) and both generate exactly ``--new-tokens`` tokens per row (no stop
token), greedy and sampled (temperature 0.8, top-p 0.95). Tokens/s = batch x new tokens / seconds,
the median of ``--repeats`` timed runs after one warm-up, the two
implementations taking turns. Greedy runs also report how many generated
tokens the two agree on (both in float32: they should be all). In bfloat16 they need not: one rounding
that tips a near-tie makes the rest of the row differ, and the random debug model's logits are close
(top-2 gap under 0.03 at a tenth of the positions, where bfloat16 moves logits by about 0.02); so a
bfloat16 run also reports how often titanium's model in bfloat16 and in float32, fed the same tokens
(titanium's greedy output), pick different next tokens. On CUDA titanium's decode step is compiled
(``torch.compile`` over a static KV cache) unless ``--no-compile``.

    python benchmarks/generation.py --threads 1 --out benchmarks/results/generation_cpu.md   # CPU, debug model
    python benchmarks/generation.py --device cuda --dtype bfloat16 --batches 1 16 64 \\
        --out benchmarks/results/generation_h100.md                                         # a GPU
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from titanium.checkpoint.hf import save_hf_weights
from titanium.data.tokenizer import DEFAULT_TOKENIZER_PATH, TiktokenTokenizer
from titanium.generation.generate import generate
from titanium.generation.sampling import SamplingParams
from titanium.model_builder import ModelBuilder
from titanium.models import build_model_args, get_model_spec

REPO = Path(__file__).resolve().parents[1]
SAMPLED = {"temperature": 0.8, "top_p": 0.95}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cores, load = os.cpu_count(), os.getloadavg()[1]  # the 5-minute load: how shared the machine was
    name = platform.processor() or platform.machine()
    return f"CPU ({name}, {cores} cores, load {load:.1f}; {torch.get_num_threads()} threads)"


def debug_folder(out: Path) -> Path:
    """The debug model with seeded random weights, exported as a Hugging Face folder."""
    spec = get_model_spec("llama3")
    args = build_model_args(
        spec, "debugmodel", vocab_size=TiktokenTokenizer(str(REPO / DEFAULT_TOKENIZER_PATH)).vocab_size
    )
    model = ModelBuilder(torch.device("cpu"), seed=0).build(spec, args).model
    return save_hf_weights(model.state_dict(), out, spec.hf_adapter, args)


def timed(
    runs: dict[str, Callable[[], torch.Tensor]], repeats: int, device: torch.device
) -> dict[str, tuple[float, torch.Tensor]]:
    """Median seconds of ``repeats`` calls of each run after a warm-up, and its last result. The runs
    take turns, so a change in the machine's load hits them alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    results = {name: fn() for name, fn in runs.items()}  # warm-up
    for _ in range(repeats):
        for name, fn in runs.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            results[name] = fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(times[name]), results[name]) for name in runs}


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-folder", type=Path, help="a Llama / Qwen3 HF folder (default: the debug model)")
    parser.add_argument("--model", default="llama3", help="titanium family of --hf-folder")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="titanium's compiled decode step (default: on for CUDA, off on CPU)",
    )
    parser.add_argument("--threads", type=int, help="CPU threads (torch.set_num_threads; default: torch's choice)")
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    return parser


def run(args: argparse.Namespace) -> tuple[list[tuple[int, str, float, float, float | None]], str]:
    """The rows (batch, decoding, titanium tokens/s, HF tokens/s, share of equal greedy tokens) and the
    markdown table."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    compile_decode = device.type == "cuda" if args.compile is None else args.compile

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.hf_folder or debug_folder(Path(tmp) / "hf")
        built = ModelBuilder(device).load_hf(get_model_spec(args.model), folder)
        ours, model_args = built.model.to(dtype).eval(), built.args
        exact = (
            None if dtype == torch.float32 else ModelBuilder(device).load_hf(get_model_spec(args.model), folder).model
        )
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype).to(device).eval()
    vocab = model_args.vocab_size
    pad = 0

    rows = []
    for batch in args.batches:
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(1, vocab, (batch, args.prompt_len), generator=g).to(device)
        for mode, sampling in (("greedy", {"temperature": 0.0}), ("sampled", SAMPLED)):
            params = SamplingParams(max_new_tokens=args.new_tokens, **sampling)
            generator = torch.Generator(device).manual_seed(0)

            def titanium_run(
                prompts: torch.Tensor = prompts, params: SamplingParams = params, generator: torch.Generator = generator
            ) -> torch.Tensor:
                out = generate(ours, prompts.tolist(), params, set(), pad, generator=generator, compile=compile_decode)
                return out.tokens

            hf_kwargs = {"do_sample": False} if mode == "greedy" else {"do_sample": True, "top_k": 0, **SAMPLED}

            @torch.no_grad()
            def hf_run(prompts: torch.Tensor = prompts, hf_kwargs: dict = hf_kwargs) -> torch.Tensor:
                out = hf.generate(
                    prompts,
                    attention_mask=torch.ones_like(prompts),
                    max_new_tokens=args.new_tokens,
                    min_new_tokens=args.new_tokens,
                    pad_token_id=pad,
                    **hf_kwargs,
                )
                return out[:, args.prompt_len :]

            timings = timed({"titanium": titanium_run, "hf": hf_run}, args.repeats, device)
            (ours_s, ours_tokens), (hf_s, hf_tokens) = timings["titanium"], timings["hf"]
            n = batch * args.new_tokens
            agree = (ours_tokens == hf_tokens).float().mean().item() if mode == "greedy" else None
            flips = argmax_flips(ours, exact.eval(), prompts, ours_tokens) if mode == "greedy" and exact else None
            rows.append((batch, mode, n / ours_s, n / hf_s, agree, flips))
            print(rows[-1], file=sys.stderr)

    lines = [
        "# Generation throughput: titanium vs Hugging Face `generate`",
        "",
        f"Device: {device_name(device)}, {args.dtype}; torch {torch.__version__}, transformers "
        f"{transformers.__version__}, Python {platform.python_version()}.",
        f"Model: {args.hf_folder or 'debug Llama (random weights, exported by titanium)'}; prompts of "
        f"{args.prompt_len} tokens, {args.new_tokens} new tokens per row, no stop token; median of "
        f"{args.repeats} runs after a warm-up, titanium and HF taking turns."
        + (" titanium's decode step compiled." if compile_decode else ""),
        f"Command: `python {' '.join(sys.argv)}`",
        "",
        "| batch | decoding | titanium tokens/s | HF generate tokens/s | titanium / HF | greedy tokens equal "
        f"| next-token flips, {args.dtype} vs float32 (same tokens) |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for batch, mode, ours_tps, hf_tps, agree, flips in rows:
        equal = f"{100 * agree:.1f}%" if agree is not None else "(sampled)"
        flipped = f"{100 * flips:.1f}%" if flips is not None else ""
        lines.append(
            f"| {batch} | {mode} | {ours_tps:,.0f} | {hf_tps:,.0f} | {ours_tps / hf_tps:.2f}x | {equal} | {flipped} |"
        )
    return rows, "\n".join(lines) + "\n"


@torch.no_grad()
def argmax_flips(model: torch.nn.Module, exact: torch.nn.Module, prompts: torch.Tensor, tokens: torch.Tensor) -> float:
    """Share of the generated positions where ``model`` and its float32 twin ``exact``, both fed prompt + the
    same generated tokens, pick different next tokens: the rounding's own rate of tipping a greedy choice."""
    seq = torch.cat([prompts, tokens], 1)
    positions = slice(prompts.shape[1] - 1, -1)  # (the logits that chose each generated token)
    picks = [m(seq)[:, positions].argmax(-1) for m in (model, exact)]
    return (picks[0] != picks[1]).float().mean().item()


def main() -> None:
    args = parser().parse_args()
    _, text = run(args)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
