"""``torchrun --nproc_per_node 2 -m tests.vllm.split_checks OUT_DIR``: one colocated vLLM engine split over 2 ranks.

Both ranks train the small head_dim-32 Llama of ``engine_checks`` sharded with FSDP2 (gloo) and each has its own
prompts and seed, as GRPO's data-parallel ranks do. ``--rollout.tensor_parallel_size 2``: one vLLM engine in
tensor parallelism over the two processes (``external_launcher``). The engine is synced from the sharded policy (A),
then each rank generates its own prompts, greedily and sampled at temperature 1: the engine gathers both ranks'
requests, generates them in one call and gives each rank its rows, which must be what the policy makes of that
rank's prompts (greedy: titanium's own greedy tokens; sampled: the engine's log-probs of the sampled tokens equal
the policy's forward of this rank's prompt and answer). Then a training step at a large learning rate (B), a sync,
the same checks at B and the stale contrast, and both ranks sending one request (the ranks of one data-parallel
rank do, under tensor parallelism): generated once, both get it. Each rank writes ``rank<r>.json``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

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
from titanium.generation.generate import generate
from titanium.generation.sampling import SamplingParams
from titanium.parallel.distributed import shutdown_distributed
from titanium.peft.merge import merged_full_state_dict

GREEDY, SAMPLED = SamplingParams(max_new_tokens=16, temperature=0.0), SamplingParams(max_new_tokens=16)
STOP = {2}


def against_policy(engine: Any, reference: Any, prompts: list[list[int]], seed: int) -> dict[str, Any]:
    """This rank's prompts through the split engine against the policy ``reference`` (one process, same weights)."""
    greedy = engine.generate(prompts, GREEDY, seed=seed).generation
    own = generate(reference, prompts, GREEDY, STOP, pad_id=0)
    sampled = engine.generate(prompts, SAMPLED, seed=seed)
    return {
        "greedy_equals_policy": greedy.tokens.tolist() == own.tokens.tolist(),
        "sampled_vs_policy": sampled_vs_titanium(reference, prompts, sampled.generation),
        "sampled": sampled.generation.tokens.tolist(),
        "version": sampled.version,
    }


def main(out: Path) -> None:
    rank, spec, args, reference, model = fsdp_policy("llama3")
    engine = vllm_engine(spec, args, seed=rank, stop_ids=STOP, tensor_parallel_size=2)
    from vllm.distributed.parallel_state import get_tp_group

    seqs, mine = sequences(), [s[:16] for s in sequences()[4 * rank : 4 * rank + 4]]
    results = {"engine_ranks": dist.get_process_group_ranks(engine.group), "vllm_tp_ranks": get_tp_group().ranks}
    results["sync_a"] = dataclasses.asdict(engine.sync_from(model, version=0))
    logprobs_a = titanium_logprobs(reference, seqs)
    results["engine_vs_policy_a"] = diff(engine_logprobs(engine, seqs), logprobs_a)
    results["a"] = against_policy(engine, reference, mine, seed=1000 * rank)
    one_large_step(model)
    reference.load_state_dict(merged_full_state_dict(model, keep=True))  # B: the sharded policy, gathered
    results["sync_b"] = dataclasses.asdict(engine.sync_from(model, version=1))
    engine_b = engine_logprobs(engine, seqs)
    results["engine_vs_policy_b"] = diff(engine_b, titanium_logprobs(reference, seqs))
    results["engine_b_vs_policy_a"] = diff(engine_b, logprobs_a)
    results["b"] = against_policy(engine, reference, mine, seed=1000 * rank)
    shared = engine.generate([s[:16] for s in seqs[8:12]], SAMPLED, seed=7)  # (both ranks: one request)
    results["same_request"] = shared.generation.tokens.tolist()
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=2))
    engine.close()  # (last: vLLM's teardown also destroys the default process group it shared)
    shutdown_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
