"""``node_checks OUT_DIR`` under two torchrun agents (2 simulated machines x 2 ranks): an engine process per node.

The four ranks train the small head_dim-32 Llama of ``engine_checks`` sharded with FSDP2 over all of them (gloo),
each with its own prompts and seed. ``--rollout.server_per node``: the first rank of each machine (torchrun's
``LOCAL_WORLD_SIZE`` consecutive ranks) starts an engine process and serves its machine's ranks; every rank syncs
the policy, then generates its own prompts, greedily and sampled at temperature 1: each rank's rows must be what the
policy makes of that rank's prompts (``split_checks.against_policy``). Both ranks of a machine sending one request
get one answer. Each rank writes ``rank<r>.json``, with its engine group's ranks and the engine process it used.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch.distributed as dist

from tests.vllm.engine_checks import fsdp_policy, sequences, vllm_engine
from tests.vllm.server_checks import running
from tests.vllm.split_checks import SAMPLED, STOP, against_policy
from titanium.parallel.distributed import shutdown_distributed


def main(out: Path) -> None:
    rank, spec, args, reference, model = fsdp_policy("llama3")
    engine = vllm_engine(spec, args, seed=rank, stop_ids=STOP, mode="server", server_per="node")
    seqs, results = sequences(), {}
    results["engine_ranks"] = dist.get_process_group_ranks(engine.group)
    results["owns_engine"] = engine.owner
    pid = engine.server.process.pid if engine.server is not None else None
    owners = [None] * dist.get_world_size()
    dist.all_gather_object(owners, pid)
    results["engine_pids"] = owners
    results["sync"] = dataclasses.asdict(engine.sync_from(model, version=0))
    results["a"] = against_policy(engine, reference, [s[:16] for s in seqs[4 * rank : 4 * rank + 4]], 1000 * rank)
    machine = rank // 2
    shared = engine.generate([s[:16] for s in seqs[machine : machine + 4]], SAMPLED, seed=7 + machine)
    results["same_request"] = shared.generation.tokens.tolist()
    engine.close()
    results["closed"] = pid is None or not running(pid)
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=2))
    shutdown_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
