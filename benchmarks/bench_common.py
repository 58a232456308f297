"""What the benchmarks that run the real trainer share: the machine they ran on, the trainer run as a user runs
it (a fresh ``python -m titanium.train`` process per variant, read back through its TensorBoard scalars), a
tokenizer file of a given vocabulary size, and the results file.

Not a benchmark itself; ``python benchmarks/bench_common.py --layers N -- <titanium.train flags>`` is how the
scripts train a model whose flavor keeps every dimension but has fewer blocks (to fit one GPU).
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import itertools
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TAGS = {
    "tps": "throughput/tps",
    "mfu": "throughput/mfu_pct",
    "memory": "memory/peak_gib",
    "padding": "data/padding_pct",
}
"""The trainer's TensorBoard tags the benchmarks read (titanium/metrics/logger.py)."""


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    load = os.getloadavg()[1]  # the 5-minute load: how shared the machine was
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {load:.1f})"


def environment(device: torch.device) -> str:
    """Device and the versions that decide speed: torch, torchao, CUDA (where used)."""
    import torchao

    cuda = f", CUDA {torch.version.cuda}" if device.type == "cuda" else ""
    return f"Device: {device_name(device)}; torch {torch.__version__}, torchao {torchao.__version__}{cuda}."


def command_line() -> str:
    """The command that produced a results file, as it was typed."""
    return "python " + shlex.join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])


def python_path() -> str:
    """PYTHONPATH for a child process: the repository first, then whatever was set (an install into a target
    folder, as the GPU suite makes from carried wheels, must stay visible)."""
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def launcher(nproc: int) -> list[str]:
    """The start of a command that runs a script in ``nproc`` processes: python for one, torchrun for several."""
    if nproc == 1:
        return [sys.executable]
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0",
    ]  # fmt: skip


def vocab_tokenizer(folder: Path, vocab_size: int) -> Path:
    """A tiktoken ranks file giving exactly ``vocab_size`` ids (its ranks plus titanium's 256 special tokens):
    the 256 bytes, then byte pairs, then byte triples. Throughput depends on the vocabulary's size, not on
    which text made the ids, and the hub's tokenizers cannot be downloaded here; every byte being a token,
    it still encodes any text."""
    from titanium.data.tokenizer import NUM_SPECIAL_TOKENS

    n_ranks = vocab_size - NUM_SPECIAL_TOKENS
    words = itertools.chain.from_iterable(itertools.product(range(256), repeat=n) for n in (1, 2, 3))
    path = folder / f"vocab_{vocab_size}.tiktoken"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    lines = (f"{base64.b64encode(bytes(w)).decode()} {rank}" for rank, w in zip(range(n_ranks), words))
    path.write_text("\n".join(lines) + "\n")
    return path


def train(
    flags: list[str],
    folder: Path,
    layers: int | None = None,
    timeout: float | None = None,
    cpu: bool = False,
    tags: dict[str, str] = TAGS,
) -> dict[str, float]:
    """One training run in its own process; the mean of each logged scalar of ``tags`` (key -> TensorBoard tag)
    over the steps after the first (compilation and warm-up), NaN for a tag the run did not log. ``layers``: the
    flavor cut to that many blocks; ``cpu``: hide any GPU (the trainer takes one where it sees it)."""
    entry = ["-m", "titanium.train"] if layers is None else [__file__, "--layers", str(layers), "--"]
    cmd = [sys.executable, *entry, *flags, "--job.dump_folder", str(folder), "--job.no_print_config"]
    env = {**os.environ, "PYTHONPATH": python_path(), **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {})}
    subprocess.run(cmd, cwd=REPO, check=True, timeout=timeout, env=env)
    out = {}
    for key, tag in tags.items():
        logged = series(folder, tag)
        values = [v for step, v in logged.items() if step > 1] or list(logged.values())
        out[key] = statistics.mean(values) if values else float("nan")
    return out


def attempt(flags: list[str], folder: Path, **kwargs) -> dict[str, float] | str:
    """``train``, or why it gave no numbers: one variant that fails or runs out of time leaves a row saying so,
    and the others still make their table."""
    try:
        return train(flags, folder, **kwargs)
    except subprocess.TimeoutExpired as e:
        return f"timed out after {e.timeout:.0f} s"
    except subprocess.CalledProcessError as e:
        return f"failed (exit {e.returncode}; its log is above)"


def step_times(step: Callable[[], None], device: torch.device, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` runs of ``step`` (the device synchronized around each); warm it up first."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def number(value: float, spec: str = ",.0f") -> str:
    """A table cell: the value, or n/a for NaN (a metric the device has no figure for, e.g. MFU on a CPU)."""
    return "n/a" if value != value else format(value, spec)


def cpu_header(title: str, threads: int) -> list[str]:
    """The first lines of a CPU results file: its title, the machine and torch, and the command that wrote it."""
    device = f"Device: {device_name(torch.device('cpu'))}; torch {torch.__version__}, {threads} thread(s)."
    return [f"# {title}", "", device, "", f"Command: `{command_line()}`"]


def table_rows(rows: dict, cells: Callable[[dict[str, float]], list[str]], columns: int) -> list[str]:
    """Markdown rows of a results table: the key, then ``cells(row)``, or the reason a row has no numbers (a
    string) in the first cell of ``columns - 1``."""
    lines = []
    for key, row in rows.items():
        if isinstance(row, str):
            lines.append(f"| {key} | {row} |" + " |" * (columns - 2))
        else:
            lines.append(f"| {key} | " + " | ".join(cells(row)) + " |")
    return lines


def series(folder: Path, tag: str) -> dict[int, float]:
    """step -> value of one scalar a run in ``folder`` logged (empty if it logged none)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)} if tag in acc.Tags()["scalars"] else {}


def write(text: str, out: Path | None, echo: bool = True) -> None:
    if echo:
        print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)


def _train_with_layers(layers: int, argv: list[str]) -> int:
    """titanium.train with ``[model] flavor`` replaced by a copy cut to ``layers`` blocks (registered in this
    process only, under the name ``<flavor>-<layers>L``)."""
    from titanium.config import load_config
    from titanium.models import get_model_spec
    from titanium.train import main

    model = load_config(argv).model
    spec = get_model_spec(model.name)
    name = f"{model.flavor}-{layers}L"
    spec.flavors[name] = dataclasses.replace(spec.flavors[model.flavor], n_layers=layers)
    return main([*argv, "--model.flavor", name])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("flags", nargs=argparse.REMAINDER)
    opts = parser.parse_args()
    sys.exit(_train_with_layers(opts.layers, [f for f in opts.flags if f != "--"]))
