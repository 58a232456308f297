"""How long a checkpoint save blocks the training loop: disabled vs async vs async_with_pinned_mem.

Builds a Llama 3 of 125M parameters (dim 768, 12 layers, vocab 32k) with AdamW state, then saves it
`--saves` times in each mode through titanium's CheckpointManager, doing one training step between
saves (as the loop would), and reports the blocking time per save: the time from calling save() until
the loop may run again, including the wait for staging before the next optimizer step.

    python benchmarks/checkpoint_async.py --out benchmarks/results/checkpoint_async_cpu.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from titanium.checkpoint import CheckpointManager, ModelState, OptimizerState, TrainState
from titanium.config.sections import CheckpointSection, OptimizerSection
from titanium.models.llama3 import Llama3Args, Transformer
from titanium.optim import build_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import write  # noqa: E402


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def bench(mode: str, saves: int, folder: Path, device: torch.device) -> tuple[list[float], int]:
    torch.manual_seed(0)
    args = Llama3Args(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=32000, max_seq_len=256)
    model = Transformer(args).to(device)
    optimizer = build_optimizer(model, OptimizerSection())
    tokens = torch.randint(0, args.vocab_size, (2, 128), device=device)

    def train_step() -> None:
        model(tokens).float().logsumexp(-1).mean().backward()
        manager.maybe_wait_for_staging()
        optimizer.step()
        optimizer.zero_grad()

    cfg = CheckpointSection(enable=True, async_mode=mode, keep_latest_k=1)
    states = {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer), "train_state": TrainState()}
    manager = CheckpointManager(cfg, str(folder / mode), states, rank=0)
    train_step()  # creates the optimizer state
    blocked = []
    for i in range(1, saves + 1):
        start = time.perf_counter()
        manager.save(i)
        manager.maybe_wait_for_staging()
        blocked.append(time.perf_counter() - start)
        train_step()
        manager.wait()  # keep saves from queueing: we measure blocking, not disk bandwidth
    manager.close()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{mode:>22}: blocked {statistics.median(blocked):.3f}s (median of {saves} saves)", flush=True)
    return blocked, n_params


def table(runs: dict[str, tuple[list[float], int]], opts: argparse.Namespace) -> str:
    """The modes measured so far (``disabled`` first: the others are compared with it)."""
    n_params = runs["disabled"][1]
    base = statistics.median(runs["disabled"][0])
    lines = [
        f"# Checkpoint blocking time per save ({device_name()}, torch {torch.__version__})",
        "",
        f"Command: `python benchmarks/checkpoint_async.py --saves {opts.saves}"
        + (f" --out {opts.out}`" if opts.out else "`"),
        f"Model: Llama 3, dim 768, 12 layers, vocab 32k: {n_params / 1e6:.0f}M parameters + AdamW state "
        f"({n_params * 12 / 1e9:.1f} GB saved in float32). {opts.saves} saves per mode, one training step between.",
        "",
        "| async_mode | blocked per save (median) | less blocking than disabled |",
        "|---|---|---|",
    ]
    for mode, (times, _) in runs.items():
        median = statistics.median(times)
        lines.append(f"| {mode} | {median:.3f} s | {base / median:.1f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write a markdown table here (after each mode)")
    opts = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("disabled", "async", "async_with_pinned_mem"):
            runs[mode] = bench(mode, opts.saves, Path(tmp), device)
            write(table(runs, opts), opts.out, echo=False)  # (a run stopped by a time limit keeps these)
    dist.destroy_process_group()
    print(table(runs, opts))


if __name__ == "__main__":
    main()
