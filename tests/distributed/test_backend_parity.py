"""The transformers backend trains like the native families, in every layout it offers.

Llama 3 and Qwen3 debug shapes, saved by ``transformers`` with random weights, train 10 steps on synthetic data
from the same folder with ``--model.backend native`` and ``--model.backend transformers``: in one process (Llama also
with activation checkpointing of every layer: HF layers in titanium's checkpoint wrapper), under
FSDP 2 (dp_shard 2) and TP 2 (the config's base_model_tp_plan, translated, with sequence parallelism between the
mixers), Qwen3 under CP 2 (titanium's attention
over the keys gathered from the other rank), and Llama also under PP 2 (its base_model_pp_plan: titanium's pipeline
split of the backend model). Every backend run's losses equal the native
one-process run's to 1e-5 relative (measured: 2.2e-7). A Gemma 3 (no native family: sliding windows, tied and
soft-capped logits, q/k norms whose gradients the plan sums over the ranks) under TP 2 with the chunked,
vocabulary-parallel loss, and under CP 2 (its window of 8 masked over the gathered keys), equals its one-process run.

Adam with eps 0.1 as in test_families_parallel.py: rounding-level gradient differences (the native RoPE tables are
computed in float64, transformers' in float32) stay rounding-level instead of becoming lr-sized steps where a
gradient is near zero. One launch per process count (tests/distributed/jobs_worker.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_hf_train import make_hf_debug_checkpoint
from tests.helpers import run_jobs, scalars, tiny_args
from tests.objectives.tiny_backend import save_tiny_hf

pytest.importorskip("transformers")

STEPS = 10
COMMON = ("--data.kind", "synthetic", "--optimizer.eps", "0.1", "--training.steps", str(STEPS))
FSDP = ("--training.local_batch_size", "2")  # (2 ranks x 2 rows: the one-process run's 4 rows)
TP = ("--parallelism.tensor_parallel_degree", "2")
PP = ("--parallelism.pipeline_parallel_degree", "2")
CP = ("--parallelism.context_parallel_degree", "2")
CHUNKED = ("--training.loss_chunk_size", "48")
SINGLE = {  # name: (source, backend, arguments)
    "llama3-native": ("llama3", "native", ()),
    "llama3-backend": ("llama3", "transformers", ()),
    "llama3-backend-ac": ("llama3", "transformers", ("--activation_checkpoint.mode", "full")),
    "qwen3-native": ("qwen3", "native", ()),
    "qwen3-backend": ("qwen3", "transformers", ()),
    "gemma3": ("gemma3_text", "auto", CHUNKED),
}
PARALLEL = {  # name: (source, backend, arguments, the one-process run it must equal)
    "llama3-fsdp": ("llama3", "transformers", FSDP, "llama3-native"),
    "llama3-tp": ("llama3", "transformers", TP, "llama3-native"),
    "llama3-pp": ("llama3", "transformers", PP, "llama3-native"),
    "qwen3-fsdp": ("qwen3", "transformers", FSDP, "qwen3-native"),
    "qwen3-tp": ("qwen3", "transformers", TP, "qwen3-native"),
    "qwen3-cp": ("qwen3", "transformers", CP, "qwen3-native"),
    "gemma3-tp": ("gemma3_text", "auto", TP + CHUNKED, "gemma3"),
    "gemma3-cp": ("gemma3_text", "auto", CP + CHUNKED, "gemma3"),
}


def job(tmp_path: Path, layout: str, name: str, source: Path, backend: str, extra: tuple[str, ...]) -> list[str]:
    start = ("--checkpoint.initial_load_path", str(source), "--checkpoint.initial_load_in_hf")
    return tiny_args(tmp_path / layout / name, *COMMON, *start, "--model.backend", backend, *extra)


def test_backend_equals_native_in_every_layout(tmp_path: Path) -> None:
    sources = {"llama3": tmp_path / "llama3", "qwen3": tmp_path / "qwen3", "gemma3_text": tmp_path / "gemma3"}
    for family in ("llama3", "qwen3"):
        make_hf_debug_checkpoint(sources[family], family)
    save_tiny_hf(sources["gemma3_text"], "gemma3_text")
    single = [job(tmp_path, "single", n, sources[s], b, extra) for n, (s, b, extra) in SINGLE.items()]
    run_jobs(single, 1, tmp_path / "single.json")
    parallel = [job(tmp_path, "parallel", n, sources[s], b, extra) for n, (s, b, extra, _) in PARALLEL.items()]
    run_jobs(parallel, 2, tmp_path / "parallel.json")

    def losses(layout: str, name: str) -> dict[int, float]:
        values = scalars(tmp_path / layout / name / "tb")
        assert sorted(values) == list(range(1, STEPS + 1)), (layout, name)
        return values

    for name in ("llama3-backend", "llama3-backend-ac", "qwen3-backend"):
        native, backend = losses("single", f"{name.split('-')[0]}-native"), losses("single", name)
        for step, value in native.items():
            assert backend[step] == pytest.approx(value, rel=1e-5), (name, step, backend, native)
    for name, (_, _, _, reference) in PARALLEL.items():
        expected, got = losses("single", reference), losses("parallel", name)
        for step, value in expected.items():
            assert got[step] == pytest.approx(value, rel=1e-5), (name, step, got, expected)
