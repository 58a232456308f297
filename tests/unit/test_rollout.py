"""Rollouts: groups of sampled responses, their rewards, and a training batch whose fresh forward gives
back the sampling log-probs, so that GRPO's first update sees a ratio of exactly 1."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titanium.config.sections import GRPOSection
from titanium.data.prompts import PromptSample
from titanium.data.tokenizer import ByteTokenizer
from titanium.generation.generate import left_pad
from titanium.generation.sampling import SamplingParams
from titanium.models.llama3 import LLAMA3_FLAVORS, Transformer
from titanium.objectives.grpo import group_advantages, grpo_loss
from titanium.rl.rewards.functions import RewardSet
from titanium.rl.rollout import check_peers_agree, response_logprobs, rollout

GROUP = 4
STOP_IDS = set(range(40))  # common enough under a random model that some responses finish
PARAMS = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=100)


def length(completion: str, answer: str | None, row: Mapping[str, Any]) -> float:
    """A reward that differs between responses (imported by path, as a user's function would be)."""
    return float(len(completion))


@pytest.fixture(scope="module")
def setup() -> tuple[Transformer, ByteTokenizer, list[PromptSample]]:
    tokenizer = ByteTokenizer()
    args = dataclasses.replace(
        LLAMA3_FLAVORS["debugmodel"], n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=tokenizer.vocab_size
    )
    model = Transformer(args)
    torch.manual_seed(0)
    model.init_weights()
    questions = ["What is 2+2?", "Hi", "Sort: 3 1 2"]
    samples = [PromptSample(tokenizer.encode(q, bos=True, eos=False), "4", {"q": q}) for q in questions]
    return model.train(), tokenizer, samples


def test_rollout_groups_rewards_and_logprobs_of_a_fresh_forward(setup) -> None:
    model, tokenizer, samples = setup
    rewards = RewardSet(["tests.unit.test_rollout:length"])
    out = rollout(
        model, samples, GROUP, PARAMS, rewards, tokenizer, STOP_IDS, generator=torch.Generator().manual_seed(0)
    )
    assert model.training  # restored after generating in eval mode
    batch, width = len(samples) * GROUP, max(len(s.prompt) for s in samples)
    assert out.tokens.shape[0] == batch and out.prompt_width == width
    prompts, _, _ = left_pad([s.prompt for s in samples for _ in range(GROUP)], tokenizer.pad_id)
    assert torch.equal(out.tokens[:, :width], prompts)  # group i is rows i*GROUP .. i*GROUP + GROUP - 1
    assert out.finished.any() and not out.finished.all(), "degenerate test: all or no responses stopped"
    assert len(set(out.rewards.total.tolist())) > GROUP
    for row, completion in enumerate(out.completions):
        n = int(out.response_mask[row].sum())
        ids = out.tokens[row, width : width + n].tolist()
        assert completion == tokenizer.decode(ids[:-1] if out.finished[row] else ids)
    assert out.rewards.total.tolist() == [length(c, None, {}) for c in out.completions]

    logits = model(**out.model_inputs())
    fresh = response_logprobs(logits, out.tokens, out.old_logprobs.shape[1], PARAMS.temperature)
    mask = out.response_mask
    torch.testing.assert_close(fresh[mask], out.old_logprobs[mask], rtol=0, atol=1e-5)

    # GRPO's first update: the ratio is 1, so the token-mode loss is -sum_i A_i * (tokens of response i).
    advantages = group_advantages(out.rewards.total, GROUP)
    loss_sum, units, metrics = grpo_loss(fresh, out.old_logprobs, advantages, mask, GRPOSection())
    expected = -(advantages * mask.sum(1)).sum()
    assert loss_sum.item() == pytest.approx(expected.item(), rel=1e-4, abs=1e-4)
    assert units == mask.sum() and metrics["clipped_low"] == metrics["clipped_high"] == 0
    loss_sum.backward()
    assert model.output.weight.grad is not None and model.output.weight.grad.abs().sum() > 0


def _peers_worker(rank: int, world: int, store: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        same = torch.arange(12).view(3, 4)
        cases = {
            "peers agree": (same, 0),
            "own shards": (same + rank, rank),  # (different data-parallel ranks hold different rows)
            "peers differ": (same + rank, 0),  # (one token apart: two ranks of one data-parallel rank)
        }
        for name, (tokens, shard) in cases.items():
            try:
                check_peers_agree(tokens, shard)
                results[(rank, name)] = "ok"
            except RuntimeError as e:
                results[(rank, name)] = str(e)
    finally:
        dist.destroy_process_group()


def test_peers_of_a_data_parallel_rank_must_hold_the_same_rollouts(tmp_path) -> None:
    """The run-time check of tensor/pipeline/context-parallel peers' rollouts (2 gloo processes): it passes when they
    agree or when the ranks read different shards, and raises on every rank when two peers' tokens differ."""
    results = mp.Manager().dict()
    mp.spawn(_peers_worker, args=(2, str(tmp_path / "store"), results), nprocs=2, join=True)
    for rank in range(2):
        assert results[(rank, "peers agree")] == results[(rank, "own shards")] == "ok"
        assert "data-parallel rank 0 generated different rollouts" in results[(rank, "peers differ")]
        assert "[[0], [1]]" in results[(rank, "peers differ")]
