"""benchmarks/generation.py runs its smallest case, so the benchmark cannot rot: the debug model written as a
Hugging Face folder, loaded by titanium's builder and by transformers, both decode greedily to the same tokens
(in float32); in bfloat16 it also counts the next-token flips against float32."""

from __future__ import annotations

from tests.helpers import load_script


def test_generation_benchmark_smallest_case() -> None:
    bench = load_script("benchmarks/generation.py")
    smallest = ["--batches", "2", "--prompt-len", "4", "--new-tokens", "4", "--repeats", "1"]
    rows, table = bench.run(bench.parser().parse_args(smallest))
    assert [(batch, mode) for batch, mode, *_ in rows] == [(2, "greedy"), (2, "sampled")]
    assert all(ours > 0 and hf > 0 for _, _, ours, hf, _, _ in rows)
    assert rows[0][4] == 1.0  # greedy float32: titanium and transformers pick the same tokens
    assert rows[0][5] is None  # (no lower precision to compare with float32)
    assert "| 2 | greedy |" in table

    rows, table = bench.run(bench.parser().parse_args([*smallest, "--dtype", "bfloat16"]))
    assert 0 <= rows[0][5] <= 1 and rows[1][5] is None  # bfloat16's next-token flips against float32 (greedy)
    assert "flips, bfloat16 vs float32" in table
