"""The titanium engine split over 2 tensor-parallel ranks (gloo processes) samples what a whole copy samples.

Every family's debug model (llama3; qwen2's q/k/v biases; qwen3's per-head norms; gemma2's tied embeddings and
soft-capped logits; an MoE model, whose experts stay whole) is synced into a whole engine and a split one on each
of 2 ranks, then both sample the same prompts with the same seed at temperature 1: the tokens must be equal and
the log-probs within 1e-5 (float32: the split sums its partial products in another order), on each rank, and the
two ranks' split engines must agree bitwise (they sample one token from one gathered set of logits). Each rank's
split copy holds half of every attention and dense feed-forward weight (and of an untied output projection). The
split Llama also decodes through ``torch.compile`` (``--rollout.compile``: a static KV cache, DTensor's collectives
in the graph): the same tokens as its eager decode, log-probs within 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from titanium.generation.sampling import SamplingParams
from titanium.generation.titanium_engine import TitaniumEngine
from titanium.generation.tp_plan import decoding_group
from titanium.models import get_model_spec

FAMILIES = {"llama3": "debugmodel", "qwen2": "debugmodel", "qwen3": "debugmodel", "gemma2": "debugmodel"}
FAMILIES["qwen3_moe"] = "debugmodel_moe"
PROMPTS = [[1, 17, 230, 44], [1, 9], [1, 300, 301, 302, 303, 304]]


def _split_parts(engine: TitaniumEngine) -> dict[str, float]:
    """The share of each projection weight this rank holds."""
    shares = {}
    for name, p in engine.model.named_parameters():
        if any(part in name for part in ("attention.w", "feed_forward.w", "output.")):
            shares[name] = (p.to_local() if isinstance(p, DTensor) else p).numel() / p.numel()
    return shares


def _worker(rank: int, world: int, store: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        group = decoding_group(dist.group.WORLD)
        for family, flavor in FAMILIES.items():
            spec = get_model_spec(family)
            args = spec.flavors[flavor]
            with torch.device("meta"):
                model = spec.model_cls(args)
            model.to_empty(device="cpu")
            model.init_weights(buffer_device="cpu", seed=0)  # (the same on both ranks)
            engines = {split: TitaniumEngine(spec, args, stop_ids={2}, pad_id=0, device=torch.device("cpu"),
                                             tp_group=group if split else None) for split in (False, True)}  # fmt: skip
            out = {}
            for split, engine in engines.items():
                engine.sync_from(model, version=1)
                params = SamplingParams(max_new_tokens=8, temperature=1.0)
                made = engine.generate(PROMPTS, params, seed=123).generation
                out[split] = (made.tokens, made.logprobs, made.lengths, _split_parts(engine))
            results[(rank, family)] = out
            if family == "llama3":  # (one family compiled: ~16 s here)
                compiled = TitaniumEngine(
                    spec, args, stop_ids={2}, pad_id=0, device=torch.device("cpu"), tp_group=group, compile=True
                )
                compiled.sync_from(model, version=1)
                made = compiled.generate(PROMPTS, params, seed=123).generation
                results[(rank, "llama3_compiled")] = (made.tokens, made.logprobs, made.lengths)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sampled(tmp_path_factory) -> dict:
    results = mp.Manager().dict()
    store = tmp_path_factory.mktemp("split_engine") / "store"
    mp.spawn(_worker, args=(2, str(store), results), nprocs=2, join=True)
    return dict(results)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_split_engine_samples_what_a_whole_one_does(sampled: dict, family: str) -> None:
    for rank in range(2):
        whole, split = sampled[(rank, family)][False], sampled[(rank, family)][True]
        assert torch.equal(split[0], whole[0]) and torch.equal(split[2], whole[2]), (rank, split[0], whole[0])
        torch.testing.assert_close(split[1], whole[1], rtol=0, atol=1e-5)
        print(f"{family} rank {rank}: split vs whole max |d log-prob| {(split[1] - whole[1]).abs().max():.2g}")
        assert set(whole[3].values()) == {1.0} and set(split[3].values()) == {0.5}, split[3]
    first, second = sampled[(0, family)][True], sampled[(1, family)][True]
    assert all(torch.equal(a, b) for a, b in zip(first[:3], second[:3]))


def test_a_split_engine_decodes_compiled_as_it_does_eagerly(sampled: dict) -> None:
    for rank in range(2):
        eager, compiled = sampled[(rank, "llama3")][True], sampled[(rank, "llama3_compiled")]
        assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[2], eager[2]), (rank, compiled[0])
        torch.testing.assert_close(compiled[1], eager[1], rtol=0, atol=1e-5)


def test_its_group_has_the_tensor_parallel_ranks_but_is_not_their_group(tmp_path: Path) -> None:
    mp.spawn(_group_worker, args=(4, str(tmp_path / "store")), nprocs=4, join=True)


def _group_worker(rank: int, world: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        tp = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])[0]  # (as a dp 2 x tp 2 mesh's tp groups)
        group = decoding_group(tp)
        assert dist.get_process_group_ranks(group) == dist.get_process_group_ranks(tp) == [rank % 2, rank % 2 + 2]
        assert group is not tp
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=group)
        assert value.item() == 2 * (rank % 2) + 2
    finally:
        dist.destroy_process_group()
