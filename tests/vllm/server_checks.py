"""``python -m tests.vllm.server_checks OUT.json``: vLLM in server mode (an engine process of its own).

The trainer side is this process: the small head_dim-32 Llama of ``engine_checks`` (A: its initialization, B: A
after one AdamW step at lr 3e-3). The engine process is started empty and synced through shared memory; vLLM's
teacher-forced log-probs (read in the engine process through ``call``) are compared with titanium's forward at A,
at B, and at A after syncing B (what a skipped or stale sync would leave), and sampled tokens' log-probs with
titanium's (also generated on GRPO's generation thread). Then this process writes OUT.json and kills itself
(SIGKILL), leaving no chance to close the engine: the test checks that the engine process ends on its own (a clean
``close`` is checked through the trainer's GRPO run).
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

from tests.vllm.engine_checks import (
    diff,
    engine_logprobs,
    one_large_step,
    policy,
    sampled_vs_titanium,
    sequences,
    titanium_logprobs,
    vllm_engine,
)
from titanium.generation.background import GenerationWorker
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
    cli = parser.parse_args()
    spec, args, model = policy("llama3")
    threads = torch.get_num_threads()
    start = time.perf_counter()
    engine = vllm_engine(spec, args, seed=0, stop_ids={2}, mode="server")
    results: dict[str, Any] = {"engine_start_seconds": time.perf_counter() - start, "pid": engine.process.pid}
    seqs = sequences()
    results["sync_a"] = dataclasses.asdict(engine.sync_from(model, version=0))
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
    results["sampled_vs_titanium"] = sampled_vs_titanium(model, seqs[:4], out.generation)
    worker = GenerationWorker(engine.background)  # GRPO's generation thread (max_policy_lag > 0)
    later = worker.submit(lambda: engine.generate(seqs[:4], SamplingParams(max_new_tokens=16), seed=3))
    titanium_logprobs(model, seqs)  # (the loop's work meanwhile)
    results["thread_generates_the_same"] = torch.equal(later.result().generation.tokens, out.generation.tokens)
    worker.close()
    results["trainer_threads_unchanged"] = torch.get_num_threads() == threads
    Path(cli.out).write_text(json.dumps(results, indent=2))
    os.kill(os.getpid(), signal.SIGKILL)  # (a trainer that dies without closing its engine)


if __name__ == "__main__":
    main()
