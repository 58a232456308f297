"""Generation from an FSDP-sharded policy (2 processes, gloo) equals one process on the same prompts.

Each rank samples its half of the prompts with its own generator seed, from a model sharded exactly
as training shards it (``apply_fsdp``: per block, fp32). The one-process reference runs each half
with the same seed on the unsharded model. The stop ids end rank 0's rows within two tokens while
rank 1's run on, so rank 0 must keep stepping (every forward is a collective) until both agree.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.unit.test_generation import _model
from titanium.generation.generate import Generation, all_ranks_done, generate
from titanium.generation.sampling import SamplingParams

PAD, WORLD, VOCAB = 0, 2, 256
PARAMS = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.95, top_k=50)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (4, 9, 2, 7, 5, 3, 8, 6)]


def _generate(model, prompts, rank: int, stop_ids: set[int], all_done=None) -> Generation:
    generator = torch.Generator().manual_seed(100 + rank)
    return generate(model, prompts, PARAMS, stop_ids, PAD, generator=generator, all_done=all_done)


def _worker(rank: int, store: str, stop_ids: set[int], results: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from titanium.parallel.fsdp import apply_fsdp

    timeout = timedelta(seconds=60)  # a rank running one forward too many fails the test instead of hanging it
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=timeout)
    try:
        model = _model(vocab_size=VOCAB)
        apply_fsdp(model, init_device_mesh("cpu", (WORLD,)), torch.float32, torch.float32, reshard_after_forward=True)
        calls: list[int] = []
        model.register_forward_hook(lambda *_: calls.append(1))
        out = _generate(model, _prompts()[rank::WORLD], rank, stop_ids, all_ranks_done(None, "cpu"))
        results[rank] = (out.token_lists(keep_stop=True), out.logprobs, out.finished.tolist(), len(calls))
    finally:
        dist.destroy_process_group()


def test_fsdp_generation_equals_one_process(tmp_path: Path) -> None:
    model, prompts = _model(vocab_size=VOCAB), _prompts()
    free = _generate(model, prompts[0::WORLD], 0, set()).token_lists()
    stop_ids = {row[1] for row in free}  # each of rank 0's rows stops by its second token
    reference = [_generate(model, prompts[r::WORLD], r, stop_ids) for r in range(WORLD)]
    steps = [int(r.lengths.max()) for r in reference]
    assert steps[0] <= 2 < steps[1], f"degenerate test: the ranks would stop together ({steps})"

    results = mp.Manager().dict()
    mp.spawn(_worker, args=(str(tmp_path / "store"), stop_ids, results), nprocs=WORLD, join=True)
    for rank, ref in enumerate(reference):
        tokens, logprobs, finished, calls = results[rank]
        assert tokens == ref.token_lists(keep_stop=True), rank
        assert finished == ref.finished.tolist(), rank
        width = ref.tokens.shape[1]  # rank 0 ran more steps than alone; past its rows' ends all is padding
        torch.testing.assert_close(logprobs[:, :width], ref.logprobs, rtol=0, atol=1e-5)
        assert (logprobs[:, width:] == 0).all()
        assert calls == steps[1], (rank, calls)  # both ranks: a prefill and steps[1] - 1 decode forwards
