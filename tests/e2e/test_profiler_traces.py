"""[profiling] in a real 2-rank run: a torch.profiler trace per rank of steps N, 2N, ..., and memory
snapshots that switch themselves off (once, with a warning) on CPU."""

from __future__ import annotations

import json

from tests.helpers import run_train, tiny_args


def test_each_rank_writes_a_trace_of_steps_n_and_2n(tmp_path):
    out = tmp_path / "run"
    args = tiny_args(
        out,
        "--data.kind", "synthetic",
        "--training.steps", "5",
        "--training.local_batch_size", "2",
        "--profiling.enable_profiling",
        "--profiling.profile_freq", "2",
        "--profiling.profiler_warmup", "1",
        "--profiling.profiler_active", "1",
        "--profiling.enable_memory_snapshot",
    )  # fmt: skip
    result = run_train(args, nproc=2)
    traces = out / "profile_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["iteration_2", "iteration_4"]
    for step in (2, 4):
        for rank in (0, 1):
            events = json.loads((traces / f"iteration_{step}" / f"rank{rank}_trace.json").read_text())["traceEvents"]
            names = {e.get("name") for e in events}
            assert f"ProfilerStep#{step}" in names and f"ProfilerStep#{step - 1}" not in names  # warm-up unrecorded
            assert "aten::mm" in names  # the step's matmuls were recorded
    assert result.stderr.count("enable_memory_snapshot needs CUDA") == 1
    assert not (out / "memory_snapshot").exists()
