"""``torchrun --nproc_per_node 2 -m tests.vllm.colocated_checks OUT_DIR``: vLLM colocated with FSDP training.

Each rank trains the policy sharded with FSDP2 over both ranks (gloo) and runs its own vLLM engine in the same
process (``external_launcher``, engine tensor parallelism 1, the job's process group). The engine starts empty and
is synced from the sharded model (gathered block by block); after one training step at a large learning rate it is
synced again. Each rank writes ``rank<r>.json``: its engine's teacher-forced log-probs against the one-process
policy before and after the step, and a hash of what it sampled with its own seed (the ranks must differ).
The engine is closed last: vLLM's teardown destroys the default process group it shares with training.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from tests.vllm.engine_checks import (
    diff,
    engine_logprobs,
    fsdp_policy,
    one_large_step,
    sequences,
    titanium_logprobs,
    vllm_engine,
)
from titanium.generation.sampling import SamplingParams
from titanium.parallel.distributed import shutdown_distributed
from titanium.peft.merge import merged_full_state_dict


def main(out: Path) -> None:
    rank, spec, args, reference, model = fsdp_policy("llama3")
    engine = vllm_engine(spec, args, seed=rank, stop_ids={2})
    try:
        seqs = sequences()
        results = {"sync_a": dataclasses.asdict(engine.sync_from(model, version=0))}
        logprobs_a = titanium_logprobs(reference, seqs)
        results["engine_vs_policy_a"] = diff(engine_logprobs(engine, seqs), logprobs_a)
        one_large_step(model)
        reference.load_state_dict(merged_full_state_dict(model, keep=True))  # B: the sharded policy, gathered
        results["sync_b"] = dataclasses.asdict(engine.sync_from(model, version=1))
        engine_b = engine_logprobs(engine, seqs)
        results["engine_vs_policy_b"] = diff(engine_b, titanium_logprobs(reference, seqs))
        results["policy_b_vs_a"] = diff(titanium_logprobs(reference, seqs), logprobs_a)
        sampled = engine.generate(seqs[:4], SamplingParams(max_new_tokens=16), seed=1000 * rank)
        results["version"] = sampled.version
        results["sampled"] = sampled.generation.tokens.tolist()
        (out / f"rank{rank}.json").write_text(json.dumps(results, indent=2))
    finally:
        engine.close()  # (vLLM's teardown also destroys the default process group it shared)
        shutdown_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
