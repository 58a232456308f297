"""Chunked linear cross-entropy against the full projection: peak memory and time of forward + backward.

For each shape, the loss of ``tokens`` hidden states against a ``vocab``-row output projection is computed
twice, as titanium computes it without and with ``[training] loss_chunk_size``: (1) full logits, then
``F.cross_entropy`` (what ``cross_entropy_sum`` does on the model's logits); (2) ``TokenCrossEntropy`` with
the given chunk size, which also drops the unlabelled tokens (``--ignored`` of them, e.g. SFT prompts) before
the projection. Peak memory is what the loss allocates beyond its inputs (CPU: profiler allocation events;
CUDA: allocator peak), time is the median of ``--repeats`` runs.

    python benchmarks/chunked_ce.py --out benchmarks/results/chunked_ce_cpu.md                    # CPU shapes
    python benchmarks/chunked_ce.py --device cuda --dtype bfloat16 --tokens 8192 --dim 4096 \\
        --out benchmarks/results/chunked_ce_h100.md                                               # Llama 3 8B head
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import step_times  # noqa: E402

from titanium.batch import Batch  # noqa: E402
from titanium.debug.memory import peak_memory_bytes  # noqa: E402
from titanium.objectives.base import IGNORE_INDEX, ModelOutput  # noqa: E402
from titanium.objectives.losses.cross_entropy import TokenCrossEntropy, TokenFields  # noqa: E402

VOCABS = {"Llama 2 (32,000)": 32000, "Llama 3 (128,256)": 128256, "Qwen3 (151,936)": 151936}
MIB = 2**20


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def measure(loss_fn, hidden, projection, batch, device, repeats: int) -> tuple[float, float]:
    """(peak MiB, median seconds) of one forward + backward of ``loss_fn``."""

    def step() -> None:
        loss = loss_fn(hidden, projection, batch)
        loss.backward()
        hidden.grad = projection.weight.grad = None

    step()  # warm-up (allocator, kernels)
    peak = peak_memory_bytes(step, device) / MIB
    return peak, statistics.median(step_times(step, device, repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per microbatch (batch x seq_len)")
    parser.add_argument("--dim", type=int, default=128, help="hidden size")
    parser.add_argument("--chunk", type=int, default=256, help="loss_chunk_size")
    parser.add_argument("--ignored", type=float, default=0.5, help="share of tokens without a label")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    full, chunked = TokenCrossEntropy(0), TokenCrossEntropy(args.chunk)

    def full_loss(hidden, projection, batch):
        return full(ModelOutput(logits=projection(hidden).float()), batch)

    def chunked_loss(hidden, projection, batch):
        return chunked(ModelOutput(hidden=hidden, projection=projection), batch)

    rows = []
    for name, vocab in VOCABS.items():
        hidden = torch.randn(1, args.tokens, args.dim, device=device, dtype=dtype, requires_grad=True)
        projection = torch.nn.Linear(args.dim, vocab, bias=False, device=device, dtype=dtype)
        labels = torch.randint(0, vocab, (1, args.tokens), device=device)
        labels[:, : int(args.ignored * args.tokens)] = IGNORE_INDEX
        (batch,) = chunked.prepare([Batch(torch.zeros_like(labels), TokenFields(labels))])
        results = {}
        for label, fn in (("full", full_loss), ("chunked", chunked_loss)):
            results[label] = measure(fn, hidden, projection, batch, device, args.repeats)
        (full_mib, full_s), (chunk_mib, chunk_s) = results["full"], results["chunked"]
        logits_mib = args.tokens * vocab * 4 / MIB
        rows.append(
            f"| {name} | {logits_mib:,.0f} | {full_mib:,.0f} | {chunk_mib:,.0f} | {full_mib / chunk_mib:.1f}x "
            f"| {full_s * 1e3:,.0f} | {chunk_s * 1e3:,.0f} |"
        )
        print(rows[-1], flush=True)
        del hidden, projection
    command = "python benchmarks/chunked_ce.py " + " ".join(sys.argv[1:])
    text = "\n".join(
        [
            f"# Chunked linear cross-entropy: {args.tokens} tokens, dim {args.dim}, {args.dtype}, "
            f"chunk {args.chunk}, {args.ignored:.0%} of tokens unlabelled",
            "",
            f"Device: {device_name(device)}, torch {torch.__version__}. Command: `{command}`.",
            "Peak: memory the loss's forward + backward allocates beyond its inputs (the logits' float32 size",
            "for scale). Time: median of the repeats. The full path holds the logits, their float32 copy or",
            "softmax and their gradient; the chunked one about two [chunk, vocab] float32 buffers and the",
            "weight gradient, whatever the number of tokens, and it projects only the labelled tokens (at the",
            "price of recomputing their logits in the backward).",
            "",
            "| vocabulary | float32 logits MiB | full peak MiB | chunked peak MiB | full / chunked "
            "| full ms | chunked ms |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
        ]
    )
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
