"""``python -m tests.vllm.server_checks OUT.json [--crash]``: vLLM in server mode (an engine process of its own).

The trainer side is this process: the small head_dim-32 Llama of ``engine_checks`` (A: its initialization, B: A
after one AdamW step at lr 3e-3). The engine process is started empty and synced through shared memory; vLLM's
teacher-forced log-probs (read in the engine process through ``call``) are compared with titanium's forward at A,
at B, and at A after syncing B (what a skipped or stale sync would leave). Then the engine is closed and its process
must be gone. With ``--crash`` this process kills itself (SIGKILL) after the first sync, leaving no chance to close:
the test checks that the engine process it wrote to OUT.json ends on its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from tests.vllm.engine_checks import diff, engine_logprobs, one_large_step, policy, sequences, titanium_logprobs
from titanium.config.sections import RolloutSection
from titanium.generation.engine import build_engine
from titanium.generation.sampling import SamplingParams


def running(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie waiting to be reaped has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--crash", action="store_true")
    cli = parser.parse_args()
    spec, args, model = policy("llama3")
    threads = torch.get_num_threads()
    start = time.perf_counter()
    engine = build_engine(
        RolloutSection(engine="vllm", mode="server", max_num_batched_tokens=4096),
        spec,
        args,
        stop_ids={2},
        pad_id=0,
        max_model_len=512,
        device=torch.device("cpu"),
        training_dtype=torch.float32,
        seed=0,
    )
    results: dict[str, Any] = {"engine_start_seconds": time.perf_counter() - start, "pid": engine.process.pid}
    seqs = sequences()
    results["sync_a"] = dataclasses.asdict(engine.sync_from(model, version=0))
    if cli.crash:
        Path(cli.out).write_text(json.dumps(results))
        os.kill(os.getpid(), signal.SIGKILL)
    a = titanium_logprobs(model, seqs)
    results["engine_a_vs_titanium_a"] = diff(engine.call(engine_logprobs, seqs), a)
    one_large_step(model)
    b = titanium_logprobs(model, seqs)
    results["titanium_b_vs_a"] = diff(b, a)
    results["sync_b"] = dataclasses.asdict(engine.sync_from(model, version=1))
    engine_b = engine.call(engine_logprobs, seqs)
    results["engine_b_vs_titanium_b"] = diff(engine_b, b)
    results["engine_b_vs_titanium_a"] = diff(engine_b, a)
    out = engine.generate(seqs[:4], SamplingParams(max_new_tokens=16), seed=3)
    results["version"] = out.version
    mask = out.generation.mask()
    full = [seqs[row] + out.generation.tokens[row].tolist() for row in range(4)]
    expected = titanium_logprobs(model, full)[:, len(seqs[0]) - 1 :]
    results["sampled_vs_titanium"] = diff(out.generation.logprobs[mask], expected[mask])
    results["trainer_threads_unchanged"] = torch.get_num_threads() == threads
    start = time.perf_counter()
    engine.close()
    results["close_seconds"] = time.perf_counter() - start
    results["running_after_close"] = running(results["pid"])
    Path(cli.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
