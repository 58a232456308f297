"""The data pipeline on 2 gloo ranks (one torchrun launch of data_pipeline_worker.py).

- Each rank parses only its share of every file (its byte range): the lines the ranks parsed are disjoint
  and together are every line of the data once, bad lines included (skipped and counted by their owner).
- Prefetching 4 batches in a background thread gives the same batches as reading inline, and after each
  batch the same saved state (the state of the batches handed out, not of the ones prefetched).
- Resuming from a mid-run state gives the same next batches as the uninterrupted run and parses exactly the
  rows the uninterrupted run parsed after that point: nothing before it is read again.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO, env

WORLD = 2


def _write_data(folder) -> list[str]:
    """Two files of documents of varied length, with one broken line each; returns every line."""
    lines = []
    for name, n, bad in (("a.jsonl", 150, 40), ("b.jsonl", 90, 71)):
        rows = [json.dumps({"text": f"doc {name} {i} " + "x" * (i % 13)}) for i in range(n)]
        rows[bad] = '{"text": oops ' + name
        (folder / name).write_text("\n".join(rows) + "\n")
        lines += rows
    return lines


def test_ranks_read_disjoint_shares_prefetch_and_resume_exactly(tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir(), out.mkdir()
    lines = _write_data(data)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0", str(REPO / "tests/distributed/data_pipeline_worker.py"), str(data), str(out),
    ]  # fmt: skip
    job = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=240)
    assert job.returncode == 0, job.stderr[-4000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]

    parsed = [r["pass_parsed"] for r in reports]
    assert not set(parsed[0]) & set(parsed[1])
    assert sorted(parsed[0] + parsed[1]) == sorted(lines)  # every line once, by one rank
    assert all(len(p) > len(lines) // 4 for p in parsed)  # both ranks got a real share
    assert sum(r["bad_rows"] for r in reports) == 2
    for r in reports:  # every good line parsed is handed on
        assert len(r["pass_rows"]) == len(r["pass_parsed"]) - sum("oops" in line for line in r["pass_parsed"])

    for rank, r in enumerate(reports):
        assert r["prefetch_same_batches"] and r["prefetch_same_states"] and r["epochs_crossed"] >= 1, rank
        assert r["prefetch_state_is_handed_out_state"], rank
        assert r["resumed_same_batches"], rank
        assert r["parsed_when_resumed"] == r["parsed_after_state"], rank
        assert not set(r["parsed_when_resumed"]) & set(r["parsed_before_state"]), rank
        assert len(r["parsed_before_state"]) > 5  # the state was taken mid-run
