"""Optimizer memory: state bytes and the peak of one training step, for AdamW, torchao's 8-bit / 4-bit / FP8
AdamW, and optimizer-in-backward (optimizer.early_step_in_backward).

Builds a Llama 3 of 125M parameters (dim 768, 12 layers, vocab 32k, float32 weights), takes two warm-up steps
per configuration (the first creates the optimizer state and compiles torchao's step), then measures the third:
- state: bytes of every tensor in the optimizer state (a quantized state counts its codes and scales);
- peak: the most tensor memory alive during forward + backward + step + zero_grad. On CPU this is tracked from
  torch's allocator events (torch.profiler with profile_memory) on top of what was alive when the step began
  (weights, buffers, state); on CUDA it is torch.cuda.max_memory_allocated.

    python benchmarks/optimizer_memory.py --out benchmarks/results/optimizer_memory_cpu.md
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from titanium.config.sections import LRSchedulerSection, OptimizerSection
from titanium.models.llama3 import Llama3Args, Transformer
from titanium.optim import build_lr_scheduler, build_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import write  # noqa: E402

CONFIGS = {
    "AdamW (fused)": OptimizerSection(),
    "AdamW, in backward": OptimizerSection(early_step_in_backward=True),
    "AdamW8bit": OptimizerSection(name="AdamW8bit"),
    "AdamW4bit": OptimizerSection(name="AdamW4bit"),
    "AdamWFp8": OptimizerSection(name="AdamWFp8"),
    "AdamW8bit, in backward": OptimizerSection(name="AdamW8bit", early_step_in_backward=True),
}
_MIB = 2**20


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes held by distinct storages; a tensor subclass (torchao's quantized state) counts its inner tensors."""
    seen, total = set(), 0
    stack = list(tensors)
    while stack:
        t = stack.pop()
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            stack.extend(getattr(t, name) for name in names)
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def peak_bytes(step: Callable[[], None], live_before: int, device: torch.device) -> int:
    """Most tensor bytes alive while `step` runs (on CPU: `live_before` plus the highest net allocation)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    current = highest = 0
    for _, nbytes in events:
        current += nbytes
        highest = max(highest, current)
    return live_before + highest


def measure(cfg: OptimizerSection, device: torch.device, batch: int, seq_len: int) -> dict[str, float]:
    torch.manual_seed(0)
    args = Llama3Args(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=32000, max_seq_len=seq_len)
    model = Transformer(args).to(device)
    with torch.no_grad():
        model.init_weights()
    optimizer = build_optimizer(model, cfg)
    scheduler = build_lr_scheduler(optimizer, LRSchedulerSection(warmup_steps=2), total_steps=10)
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len + 1), device=device)

    def train_step() -> None:
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        del logits
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

    train_step()
    train_step()
    weights = tensor_bytes([*model.parameters(), *model.buffers()])
    state = tensor_bytes(state_tensors(optimizer))
    peak = peak_bytes(train_step, live_before=weights + state, device=device)
    n_params = sum(p.numel() for p in model.parameters())
    return {"params": n_params, "weights": weights, "state": state, "peak": peak}


def table(results: dict[str, dict[str, float]], opts: argparse.Namespace, device: torch.device) -> str:
    """The rows measured so far, with ratios against the first (AdamW)."""
    base = next(iter(results.values()))
    how = "torch.profiler allocator events" if device.type == "cpu" else "torch.cuda.max_memory_allocated"
    command = f"python benchmarks/optimizer_memory.py --batch {opts.batch} --seq-len {opts.seq_len}"
    lines = [
        f"# Optimizer memory ({device_name(device)}, torch {torch.__version__})",
        "",
        f"Command: `{command}" + (f" --out {opts.out}`" if opts.out else "`"),
        f"Model: Llama 3, dim 768, 12 layers, vocab 32k: {base['params'] / 1e6:.0f}M parameters, float32 weights "
        f"({base['weights'] / _MIB:.0f} MiB with buffers); batch {opts.batch} x {opts.seq_len} tokens. "
        f"Peak: most tensor memory alive during the third step (forward, backward, step, zero_grad), by {how}.",
        "",
        "| optimizer | state | state vs AdamW | peak in a step | peak vs AdamW | at the peak besides weights + state |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['state'] / _MIB:.1f} MiB | {r['state'] / base['state']:.2f}x | {r['peak'] / _MIB:.1f} MiB "
            f"| {r['peak'] / base['peak']:.2f}x | {(r['peak'] - r['weights'] - r['state']) / _MIB:.1f} MiB |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None, help="write a markdown table here (after each optimizer)")
    opts = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = {}
    for name, cfg in CONFIGS.items():
        results[name] = r = measure(cfg, device, opts.batch, opts.seq_len)
        print(f"{name:>24}: state {r['state'] / _MIB:8.1f} MiB  peak {r['peak'] / _MIB:8.1f} MiB", flush=True)
        write(table(results, opts, device), opts.out, echo=False)  # (a run stopped by a time limit keeps these)
    print(table(results, opts, device))


if __name__ == "__main__":
    main()
