"""The experts' grouped GEMM three ways: ``torch._grouped_mm``, one padded ``bmm``, a loop over experts.

Forward + backward of the stacked SwiGLU experts (``titanium.models.common.moe.expert_swiglu``) on rows sorted
by expert, with the per-expert counts of a real router (random top-k of a softmax, so the groups are uneven).
All three compute the same numbers (checked here against the loop); the MoE layer picks one per device and dtype
(``grouped_gemm_kind``), and this script is what that choice rests on. Time: median of ``--repeats`` runs.

    python benchmarks/moe_layer.py --out benchmarks/results/moe_layer_cpu.md              # CPU shapes, fp32 + bf16
    python benchmarks/moe_layer.py --device cuda --dtype bfloat16 --shape 8192,2048,768,128,8 \\
        --out benchmarks/results/moe_layer_h100.md                                          # one Qwen3-30B-A3B layer
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import command_line, device_name, step_times, write  # noqa: E402

from titanium.models.common.moe import expert_swiglu, grouped_gemm_kind  # noqa: E402

KINDS = ("grouped_mm", "padded_bmm", "loop")
CPU_SHAPES = ("2048,256,256,8,2", "4096,512,256,32,4")
"""tokens, dim, expert hidden width, experts, top-k."""


def routed_rows(tokens: int, experts: int, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """Per-expert counts of ``tokens`` routed top-k by a random softmax router (uneven, like a real one)."""
    logits = torch.randn(tokens, experts, generator=generator) * 2
    chosen = logits.softmax(-1).topk(top_k, dim=-1).indices.flatten()
    return torch.zeros(experts, dtype=torch.long).scatter_add_(0, chosen, torch.ones_like(chosen))


def measure(shape: str, dtype: torch.dtype, device: torch.device, repeats: int) -> list[str]:
    tokens, dim, hidden, experts, top_k = (int(v) for v in shape.split(","))
    gen = torch.Generator().manual_seed(0)
    counts = routed_rows(tokens, experts, top_k, gen).to(device)
    rows = int(counts.sum())
    x = (torch.randn(rows, dim, generator=gen) / dim**0.5).to(device, dtype).requires_grad_()
    weights = [
        (torch.randn(experts, *s, generator=gen) / s[1] ** 0.5).to(device, dtype).requires_grad_()
        for s in ((hidden, dim), (dim, hidden), (hidden, dim))
    ]
    grad = torch.randn(rows, dim, generator=gen).to(device, dtype)
    results, reference = {}, None
    for kind in ("loop", *[k for k in KINDS if k != "loop"]):
        try:

            def step(kind: str = kind) -> None:
                for t in (x, *weights):
                    t.grad = None
                expert_swiglu(x, counts, *weights, kind=kind).backward(grad)

            step()
            outputs = [t.grad.float().clone() for t in (x, *weights)]
            if reference is None:
                reference = outputs
            diff = max(
                (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30) for a, b in zip(outputs, reference)
            )
            results[kind] = (statistics.median(step_times(step, device, repeats)) * 1e3, diff)
        except (RuntimeError, NotImplementedError) as e:
            results[kind] = (float("nan"), str(e).splitlines()[0][:60])
    chosen = grouped_gemm_kind(x, weights[0])
    best = min((k for k in KINDS if results[k][0] == results[k][0]), key=lambda k: results[k][0])
    cells = []
    for kind in KINDS:
        ms, diff = results[kind]
        cells.append(f"{ms:,.1f}" if ms == ms else f"fails: {diff}")
    worst = max(d for _, d in results.values() if isinstance(d, float))
    dt = str(dtype).removeprefix("torch.")
    return [f"| {tokens}x{dim}, F {hidden}, E {experts}, top-{top_k} | {dt} | {' | '.join(cells)} | {worst:.1e} | "
            f"{best} | {chosen} |"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both")
    parser.add_argument("--shape", action="append", help="tokens,dim,hidden,experts,top_k (repeatable)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    dtypes = [torch.float32, torch.bfloat16] if args.dtype == "both" else [getattr(torch, args.dtype)]
    lines = [
        "# MoE experts: grouped GEMM implementations, forward + backward",
        "",
        f"Device: {device_name(device)}; torch {torch.__version__}. Command: `{command_line()}`.",
        "Milliseconds, median of the repeats; rows sorted by expert with the uneven counts of a random top-k router.",
        "max rel diff: largest gradient difference to the loop, relative to the gradient's largest entry.",
        "",
        "| shape (tokens x dim) | dtype | grouped_mm ms | padded_bmm ms | loop ms | max rel diff | fastest | "
        "titanium uses |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for shape in args.shape or CPU_SHAPES:
        for dtype in dtypes:
            lines += measure(shape, dtype, device, args.repeats)
            print(lines[-1], flush=True)
            write("\n".join(lines) + "\n", args.out, echo=False)  # after each row: a stopped run keeps them


if __name__ == "__main__":
    main()
