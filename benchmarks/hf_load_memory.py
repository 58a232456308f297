"""Host memory of a Hugging Face load per rank at 1, 2 and 4 processes: each rank reads only its shard.

    python benchmarks/hf_load_memory.py              # writes benchmarks/results/hf_load_memory_cpu.md
    python benchmarks/hf_load_memory.py --small      # a tiny checkpoint, one case per process count (a test)

A Qwen3-MoE-shaped checkpoint (bf16, in files of at most 100 MB) is written once; then for each layout a fresh
process group (gloo, under torchrun) builds the model sharded on the meta device, allocates its shards
(``to_empty``: nothing touched yet) and loads the folder with ``load_hf_weights``. Per rank:

- shard: this rank's parameters (float32), what the load must fill;
- anonymous growth: the peak of anonymous resident memory during the load minus before: the shard as it is written
  plus what reading holds on top of it (PyTorch's allocator cannot tell: safetensors maps each file as one storage);
- file pages: the peak of file-backed resident memory minus before: the pages of the checkpoint actually read.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_common import device_name, launcher, python_path  # noqa: E402

MIB = 2**20
SHAPES = {
    "full": {"dim": 1024, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "head_dim": 128, "vocab_size": 32768,
             "num_experts": 32, "top_k": 4, "moe_dim": 512},
    "small": {"dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 32, "vocab_size": 512,
              "num_experts": 8, "top_k": 2, "moe_dim": 64},
}  # fmt: skip
LAYOUTS = {  # name -> (processes, titanium [parallelism] settings)
    "1 process": (1, {}),
    "FSDP 2": (2, {}),
    "FSDP 4": (4, {}),
    "EP 2": (2, {"expert_parallel_degree": 2}),
    "EP 4": (4, {"expert_parallel_degree": 4}),
}


def model_args(shape: str):  # type: ignore[no-untyped-def]
    from titanium.models import build_model_args, get_model_spec

    return build_model_args(get_model_spec("qwen3_moe"), "debugmodel_moe", **SHAPES[shape])


def make_checkpoint(folder: Path, shape: str) -> int:
    """Random weights in bf16; returns the checkpoint's bytes."""
    import torch

    from titanium.checkpoint.hf import save_hf_weights
    from titanium.models import get_model_spec

    spec, args = get_model_spec("qwen3_moe"), model_args(shape)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in spec.model_cls(args).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    state = {k: torch.randn(s, generator=generator, dtype=torch.bfloat16) * 0.02 for k, s in shapes.items()}
    state = {k: v.zero_() if k.endswith("expert_bias") else v for k, v in state.items()}
    save_hf_weights(state, folder, spec.hf_adapter, args, dtype=torch.bfloat16, max_shard_bytes=100 * 10**6)
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def resident() -> dict[str, int]:
    """This process's resident memory (bytes): anonymous (tensors) and file-backed (pages of memory-mapped files)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {name: int(fields[name].split()[0]) * 1024 for name in ("RssAnon", "RssFile")}


class PeakSampler(threading.Thread):
    """Samples ``resident()`` every half millisecond until stopped; keeps the peak of each kind."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = resident()
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.0005):
            self.peak = {name: max(value, self.peak[name]) for name, value in resident().items()}

    def stop(self) -> dict[str, int]:
        self._done.set()
        self.join()
        return self.peak


def _worker(out: str, folder: str, shape: str, settings: dict) -> None:
    """Build the sharded model on meta, allocate it, load the folder while sampling memory; write the numbers."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from titanium.checkpoint.hf import load_hf_weights
    from titanium.config.sections import ActivationCheckpointSection, CompileSection, ParallelismSection
    from titanium.model_builder import ModelBuilder
    from titanium.models import get_model_spec
    from titanium.parallel.dims import ParallelDims
    from titanium.parallel.parallelize import PlanConfig

    world = int(os.environ.get("WORLD_SIZE", 1))
    spec, args, cpu = get_model_spec("qwen3_moe"), model_args(shape), torch.device("cpu")
    builder = ModelBuilder(cpu)
    if world > 1:
        dist.init_process_group("gloo")
        parallelism = ParallelismSection(**settings)
        dims = ParallelDims.from_config(parallelism, world)
        plan = PlanConfig(parallelism, ActivationCheckpointSection(), CompileSection(), param_dtype=torch.float32)
        builder = ModelBuilder(cpu, 0, dims, dims.build_meshes("cpu"), plan)
    model = builder.build(spec, args, materialize=False).model
    model.to_empty(device=cpu)
    shard = sum((v.to_local() if isinstance(v, DTensor) else v).nbytes for v in model.state_dict().values())
    before, sampler, start = resident(), PeakSampler(), time.perf_counter()
    sampler.start()
    load_hf_weights(model, folder, spec.hf_adapter, args)
    seconds = time.perf_counter() - start
    peak = sampler.stop()
    result = {
        "shard": shard,
        "anon": peak["RssAnon"] - before["RssAnon"],
        "file": peak["RssFile"] - before["RssFile"],
        "seconds": seconds,
    }
    Path(out, f"rank{os.environ.get('RANK', 0)}.json").write_text(json.dumps(result))
    if world > 1:
        dist.destroy_process_group()


def measure(folder: Path, shape: str, nproc: int, settings: dict) -> list[dict]:
    """Each rank's numbers for one layout (this script's worker mode, under torchrun for several processes)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [*launcher(nproc), __file__, "--worker", out, str(folder), shape, json.dumps(settings)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path()}
        result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        if result.returncode:
            raise RuntimeError(f"load failed:\n{result.stderr[-3000:]}")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(nproc)]


def run(shape: str, layouts: dict[str, tuple[int, dict]]) -> tuple[int, dict[str, list[dict]]]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "hf"
        size = make_checkpoint(folder, shape)
        results = {}
        for name, (nproc, settings) in layouts.items():
            results[name] = measure(folder, shape, nproc, settings)
            worst = max(results[name], key=lambda r: r["anon"] + r["file"])
            print(f"{name:<10} shard {worst['shard'] / MIB:7.1f} MiB, anonymous {worst['anon'] / MIB:7.1f} MiB, "
                  f"file pages {worst['file'] / MIB:6.1f} MiB, {worst['seconds']:.2f} s", flush=True)  # fmt: skip
    return size, results


def write_results(size: int, results: dict[str, list[dict]], path: Path) -> None:
    import torch

    args = model_args("full")
    lines = [
        "# Hugging Face load: host memory per rank at 1, 2 and 4 processes",
        "",
        f"Command: `python benchmarks/hf_load_memory.py`. Device: {device_name(torch.device('cpu'))}; torch "
        f"{torch.__version__}, gloo. Checkpoint: Qwen3-MoE shape (dim {args.dim}, {args.n_layers} layers, "
        f"{args.num_experts} experts of width {args.moe_dim}, vocabulary {args.vocab_size}), bf16, "
        f"{size / MIB:.0f} MiB in files of at most 100 MB; the model holds float32. Each rank reads only the slices "
        "of its shard (`titanium/checkpoint/hf_stream.py`). Per layout, the rank whose resident memory grew most:",
        "",
        "| layout | shard MiB | anonymous growth MiB | file pages MiB | load s |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, ranks in results.items():
        worst = max(ranks, key=lambda r: r["anon"] + r["file"])
        lines.append(
            f"| {name} | {worst['shard'] / MIB:.1f} | {worst['anon'] / MIB:.1f} | {worst['file'] / MIB:.1f} | "
            f"{worst['seconds']:.2f} |"
        )
    lines += [
        "",
        "shard: the rank's float32 parameters, which the load fills (allocated before, untouched until written). "
        "anonymous growth: the peak of the process's anonymous resident memory during the load (sampled every "
        "0.5 ms from /proc/self/status) minus its value before: the shard's pages as they are written plus what "
        "reading holds on top (one tensor's box at a time). file pages: the same for file-backed resident memory: "
        "the checkpoint's pages read through the memory map (page cache, released when the files close).",
        "",
    ]
    path.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny checkpoint, FSDP at 1, 2 and 4 processes only")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/hf_load_memory_cpu.md"))
    options = parser.parse_args()
    if options.small:
        run("small", {name: LAYOUTS[name] for name in ("1 process", "FSDP 2", "FSDP 4")})
        return
    size, results = run("full", LAYOUTS)
    write_results(size, results, Path(options.out))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5]))
    else:
        main()
