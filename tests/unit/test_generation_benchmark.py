"""benchmarks/generation.py runs its smallest case, so the benchmark cannot rot: the debug model written as a
Hugging Face folder, loaded by titanium's builder and by transformers, both decode greedily to the same tokens."""

from __future__ import annotations

from tests.helpers import load_script


def test_generation_benchmark_smallest_case() -> None:
    bench = load_script("benchmarks/generation.py")
    args = bench.parser().parse_args(["--batches", "2", "--prompt-len", "4", "--new-tokens", "4", "--repeats", "1"])
    rows, table = bench.run(args)
    assert [(batch, mode) for batch, mode, *_ in rows] == [(2, "greedy"), (2, "sampled")]
    assert all(ours > 0 and hf > 0 for _, _, ours, hf, _ in rows)
    assert rows[0][4] == 1.0  # greedy float32: titanium and transformers pick the same tokens
    assert "| 2 | greedy |" in table
