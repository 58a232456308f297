"""``torchrun --nproc_per_node 2 -m tests.vllm.shared_checks OUT_DIR``: one vLLM engine process for the job.

Both ranks train the small head_dim-32 Llama of ``engine_checks`` sharded with FSDP2 (gloo) and each has its own
prompts and seed. First a model the engine refuses (head_dim 16): rank 0's engine fails to start and every rank
raises its error. Then every rank starts its own engine process (``--rollout.server_per rank``, today's server
mode), syncs the policy A and generates greedily and at temperature 1; those engines are closed. Then rank 0 alone
starts one engine for the job (``server_per job``), every rank syncs A into it and generates the same requests: each
rank must get back exactly what its own engine gave it. Then one training step at a large learning rate (B), a sync,
and the engine's log-probs against the one-process policy at B (and at A: the stale-sync contrast); a generation on
GRPO's generation thread while the loop runs collectives of its own; both ranks sending the same request (as the
ranks of one data-parallel rank do under tensor parallelism). The engine processes' and this process's resident
memory is noted per configuration. Each rank writes ``rank<r>.json``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.vllm.engine_checks import (
    diff,
    engine_logprobs,
    fsdp_policy,
    one_large_step,
    sampled_vs_titanium,
    sequences,
    titanium_logprobs,
    vllm_engine,
)
from tests.vllm.server_checks import running
from titanium.config.loader import ConfigError
from titanium.generation.background import GenerationWorker
from titanium.generation.sampling import SamplingParams
from titanium.parallel.distributed import shutdown_distributed
from titanium.peft.merge import merged_full_state_dict

GREEDY, SAMPLED = SamplingParams(max_new_tokens=16, temperature=0.0), SamplingParams(max_new_tokens=16)


def rss_mb(pid: int | str = "self") -> float:
    """Resident memory of process ``pid`` in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def generated(engine: Any, prompts: list[list[int]], seed: int) -> dict[str, Any]:
    """Greedy and seeded sampling of ``prompts``: tokens and log-probs (lists, to compare bitwise)."""
    out = {}
    for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
        g = engine.generate(prompts, params, seed=seed).generation
        out[name] = {"tokens": g.tokens.tolist(), "logprobs": g.logprobs.tolist(), "lengths": g.lengths.tolist()}
    return out


def engine_memory(engine: Any) -> list[float]:
    """Every rank's engine process resident memory, in MB (ranks without one: none)."""
    server = getattr(engine, "server", engine)
    mine = [rss_mb(server.process.pid)] if server is not None else []
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [mb for rank in everyone for mb in rank]


def main(out: Path) -> None:
    rank, spec, args, reference, model = fsdp_policy("llama3")
    seqs = sequences()
    prompts, seed = seqs[4 * rank : 4 * rank + 4], 1000 * rank + 7  # each rank's own
    results: dict[str, Any] = {"trainer_mb_start": rss_mb()}
    try:  # a model vLLM's CPU attention cannot serve (head_dim 16): rank 0's engine fails to start, every rank raises
        vllm_engine(
            spec, dataclasses.replace(args, n_heads=8), seed=rank, stop_ids={2}, mode="server", server_per="job"
        )
    except ConfigError as e:
        results["start_error"] = str(e)

    own = vllm_engine(spec, args, seed=rank, stop_ids={2}, mode="server", server_per="rank")
    own.sync_from(model, version=0)
    per_rank = generated(own, prompts, seed)
    results["rank_engines_mb"] = engine_memory(own)
    results["trainer_mb_rank"] = rss_mb()
    own.close()

    engine = vllm_engine(spec, args, seed=rank, stop_ids={2}, mode="server", server_per="job")
    results["owns_engine"] = engine.server is not None
    results["pid"] = engine.server.process.pid if engine.server is not None else None
    results["sync_a"] = dataclasses.asdict(engine.sync_from(model, version=0))
    shared = generated(engine, prompts, seed)
    results["job_engine_mb"] = engine_memory(engine)
    results["trainer_mb_job"] = rss_mb()
    results["job_equals_rank"] = {name: shared[name] == per_rank[name] for name in shared}
    results["sampled"] = shared["sampled"]["tokens"]
    sampled_a = engine.generate(prompts, SAMPLED, seed=seed)
    results["sampled_vs_titanium_a"] = sampled_vs_titanium(reference, prompts, sampled_a.generation)
    results["version_a"] = sampled_a.version
    if engine.server is not None:  # (the engine's teacher-forced log-probs, read in its process)
        results["engine_vs_policy_a"] = diff(
            engine.server.call(engine_logprobs, seqs), titanium_logprobs(reference, seqs)
        )

    one_large_step(model)
    logprobs_a = titanium_logprobs(reference, seqs)
    reference.load_state_dict(merged_full_state_dict(model, keep=True))  # B: the sharded policy, gathered
    results["policy_b_vs_a"] = diff(titanium_logprobs(reference, seqs), logprobs_a)
    results["sync_b"] = dataclasses.asdict(engine.sync_from(model, version=1))
    sampled_b = engine.generate(prompts, SAMPLED, seed=seed)
    results["version_b"] = sampled_b.version
    results["sampled_b"] = sampled_b.generation.tokens.tolist()
    results["sampled_vs_titanium_b"] = sampled_vs_titanium(reference, prompts, sampled_b.generation)
    if engine.server is not None:
        engine_b = engine.server.call(engine_logprobs, seqs)
        results["engine_vs_policy_b"] = diff(engine_b, titanium_logprobs(reference, seqs))
        results["engine_b_vs_policy_a"] = diff(engine_b, logprobs_a)

    worker = GenerationWorker(engine.background)  # GRPO's generation thread (max_policy_lag > 0)
    later = worker.submit(lambda: engine.generate(prompts, SAMPLED, seed=seed))
    for _ in range(20):  # the loop's own collectives meanwhile, on the job's group
        dist.all_reduce(torch.ones(1000))
    results["thread_generates_the_same"] = torch.equal(later.result().generation.tokens, sampled_b.generation.tokens)
    worker.close()

    same = engine.generate(seqs[:4], SAMPLED, seed=7).generation  # rank 0's request from both ranks
    results["same_request"] = same.tokens.tolist()
    engine.close()
    results["closed"] = results["pid"] is None or not running(results["pid"])
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=2))
    shutdown_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
