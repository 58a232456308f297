"""Float8 against bf16 by matmul shape: LayerNorm -> Linear -> Sigmoid, forward + backward, compiled, as in the
TorchAO paper's Figure 3 ("Observed float8 vs bfloat16 speedup ... by forward M, K, N", one H100).

The linear layer is converted by titanium's float8 converter (``[float8]`` with each recipe), the module is
compiled (as training compiles each block), and each shape's time is the median of ``--repeats`` timed
forward + backward passes (CUDA events) after warm-up. Speedup = bf16 time / float8 time, beside the paper's.
The paper does not name the recipe of its figure; torchao's default, tensorwise, is the column compared.

    python benchmarks/float8_linear.py --out benchmarks/results/float8_linear_h100.md     # 9 shapes, one GPU
    python benchmarks/float8_linear.py --all-shapes                                       # the figure's 125
    python benchmarks/float8_linear.py --device cpu --smoke                               # the CPU check
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import command_line, environment, write  # noqa: E402

from titanium.config.sections import Float8Section  # noqa: E402
from titanium.quantize.float8 import Float8Converter  # noqa: E402

SIZES = (1024, 2048, 4096, 8192, 16384)
FIGURE3 = """
    1024 1024: 0.77 0.80 0.89 0.94 0.99
    1024 2048: 0.77 0.74 0.82 0.94 0.92
    1024 4096: 0.83 0.78 0.83 0.93 0.93
    1024 8192: 0.83 0.91 1.01 1.07 0.94
    1024 16384: 0.78 0.87 0.95 0.92 1.10
    2048 1024: 0.80 0.83 0.89 0.96 1.01
    2048 2048: 0.75 0.86 1.04 1.10 1.09
    2048 4096: 0.79 0.98 1.15 1.19 1.18
    2048 8192: 0.84 1.02 1.18 1.25 1.24
    2048 16384: 0.91 1.02 1.15 1.21 1.35
    4096 1024: 0.84 0.89 1.00 1.05 1.06
    4096 2048: 0.83 0.98 1.12 1.18 1.20
    4096 4096: 0.86 1.08 1.26 1.35 1.35
    4096 8192: 1.03 1.11 1.28 1.36 1.39
    4096 16384: 0.95 1.09 1.26 1.35 1.47
    8192 1024: 0.92 0.98 1.06 1.08 1.09
    8192 2048: 0.87 1.06 1.16 1.30 1.25
    8192 4096: 0.91 1.17 1.32 1.35 1.39
    8192 8192: 0.97 1.18 1.30 1.44 1.50
    8192 16384: 0.92 1.12 1.30 1.46 1.57
    16384 1024: 0.99 1.03 1.08 1.11 1.14
    16384 2048: 0.90 1.03 1.19 1.26 1.29
    16384 4096: 0.92 1.13 1.30 1.37 1.44
    16384 8192: 0.95 1.19 1.34 1.49 1.51
    16384 16384: 1.03 1.21 1.41 1.60 1.80
"""
"""The TorchAO paper's Figure 3, "M K: speedup for N = 1024 ... 16384"."""


def paper_speedups() -> dict[tuple[int, int, int], float]:
    table = {}
    for line in FIGURE3.strip().splitlines():
        mk, values = line.split(":")
        m, k = map(int, mk.split())
        for n, value in zip(SIZES, values.split()):
            table[(m, k, n)] = float(value)
    return table


def block(k: int, n: int, recipe: str | None, device: torch.device, emulate: bool) -> nn.Module:
    """LayerNorm(K) -> Linear(K, N) -> Sigmoid in bf16; the linear layer in float8 by ``recipe`` (None: bf16)."""
    module = nn.Sequential(nn.LayerNorm(k), nn.Linear(k, n, bias=False), nn.Sigmoid()).to(device, torch.bfloat16)
    if recipe is not None:
        cfg = Float8Section(enable=True, recipe=recipe, emulate=emulate, filter_fqns=[])  # (no output layer here)
        Float8Converter(cfg, fsdp=False, device_type=None).convert(module)
    return module


def seconds(module: nn.Module, m: int, k: int, n: int, device: torch.device, repeats: int, compile: bool) -> float:
    """Median time of one forward + backward of ``m`` rows."""
    step_fn = torch.compile(module) if compile else module
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device=device, dtype=torch.bfloat16)

    def step() -> None:
        step_fn(x).backward(grad)

    for _ in range(3):  # compilation, autotuning, cuBLAS heuristics
        step()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            begin = time.perf_counter()
            step()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--smoke", action="store_true", help="one small shape, emulated float8, eager (a CPU check)")
    parser.add_argument("--all-shapes", action="store_true", help="all 125 (M, K, N) of the figure")
    parser.add_argument("--recipes", nargs="+", default=["tensorwise", "rowwise"], choices=["tensorwise", "rowwise"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    opts = parser.parse_args()
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here; --device cpu --smoke runs the CPU check")
    paper = paper_speedups()
    if opts.smoke:
        shapes, opts.repeats = [(64, 32, 48)], 2
    elif opts.all_shapes:
        shapes = sorted(paper)
    else:  # M and K = N at 1024, 4096, 16384: the figure's corners and middle
        shapes = [(m, k, k) for m, k in itertools.product((1024, 4096, 16384), repeat=2)]
    compile, emulate = not opts.smoke, opts.smoke
    lines = [
        "# Float8 vs bf16: LayerNorm -> Linear -> Sigmoid, forward + backward" + (" (smoke run)" * opts.smoke),
        "",
        f"Command: `{command_line()}`. {environment(device)}",
        f"{'Compiled' if compile else 'Eager'}{', emulated float8' if emulate else ''}; median of {opts.repeats} "
        "runs per shape. Paper: TorchAO paper, Figure 3 (one H100; recipe not named).",
        "",
        "| M | K | N | bf16 ms | "
        + " | ".join(f"{r} ms | {r} speedup" for r in opts.recipes)
        + " | Figure 3 | ratio |",
        "|---:|---:|---:|---:|" + "---:|---:|" * len(opts.recipes) + "---:|---:|",
    ]
    for m, k, n in shapes:
        bf16 = seconds(block(k, n, None, device, emulate), m, k, n, device, opts.repeats, compile)
        cells = [str(m), str(k), str(n), f"{bf16 * 1e3:.3f}"]
        speedups = {}
        for recipe in opts.recipes:
            t = seconds(block(k, n, recipe, device, emulate), m, k, n, device, opts.repeats, compile)
            speedups[recipe] = bf16 / t
            cells += [f"{t * 1e3:.3f}", f"{bf16 / t:.2f}"]
        reference = paper.get((m, k, n))
        compared = speedups.get("tensorwise")
        ratio = f"{compared / reference:.2f}" if reference and compared else ""
        cells += [f"{reference:.2f}" if reference else "", ratio]
        lines.append("| " + " | ".join(cells) + " |")
        torch._dynamo.reset()  # every shape compiles afresh; keep the cache from growing
    write("\n".join(lines) + "\n", opts.out)


if __name__ == "__main__":
    main()
