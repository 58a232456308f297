"""Token choice: top-k / top-p filters on fixed logits (by hand and against transformers' warpers), the
sampled frequencies against the filtered softmax, and the log-prob convention."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from titanium.generation.sampling import SamplingParams, filter_top_k, filter_top_p, sample, token_logprobs

INF = float("-inf")


def test_top_k_keeps_the_k_largest_logits() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5], [0.0, -1.0, 4.0, 4.0]])
    assert filter_top_k(logits, 2).tolist() == [[INF, 3.0, 2.0, INF], [INF, INF, 4.0, 4.0]]
    assert filter_top_k(logits, 1).tolist() == [[INF, 3.0, INF, INF], [INF, INF, 4.0, 4.0]]  # ties stay
    assert torch.equal(filter_top_k(logits, 0), logits) and torch.equal(filter_top_k(logits, 4), logits)


@pytest.mark.parametrize("p, kept", [(0.45, [1]), (0.74, [1, 3]), (0.76, [1, 3, 2]), (0.95, [0, 1, 2, 3])])
def test_top_p_keeps_the_smallest_set_reaching_p(p: float, kept: list[int]) -> None:
    probs = torch.tensor([0.1, 0.5, 0.15, 0.25])
    filtered = filter_top_p(probs.log()[None], p)[0]
    assert sorted(torch.isfinite(filtered).nonzero().flatten().tolist()) == sorted(kept)
    assert torch.equal(filtered[kept], probs.log()[kept])


def test_filters_equal_transformers_warpers_on_random_logits() -> None:
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(0)) * 3
    for k in (1, 7, 50):
        assert torch.equal(filter_top_k(logits, k), TopKLogitsWarper(k)(None, logits.clone()))
    for p in (0.1, 0.5, 0.9):
        assert torch.equal(filter_top_p(logits, p), TopPLogitsWarper(p)(None, logits.clone()))


def test_sampled_frequencies_follow_the_filtered_distribution() -> None:
    n = 40_000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    params = SamplingParams(max_new_tokens=1, temperature=0.7, top_k=4, top_p=0.9)
    tokens, logprobs = sample(logits.expand(n, -1), params, torch.Generator().manual_seed(0))
    expected = torch.softmax(filter_top_p(filter_top_k(logits / 0.7, 4), 0.9), dim=-1)
    assert (expected == 0).sum() >= 2, "degenerate test: the filters removed nothing"
    freq = torch.bincount(tokens, minlength=6).double() / n
    # 5 standard deviations of a frequency over n draws is at most 5 * sqrt(0.25 / n) = 0.0125.
    torch.testing.assert_close(freq, expected.double(), rtol=0, atol=0.0125)
    assert (freq[expected == 0] == 0).all()
    # Log-probs are those of the temperature-scaled distribution over the whole vocabulary (not the filtered one).
    torch.testing.assert_close(logprobs, torch.log_softmax(logits / 0.7, -1)[tokens], rtol=0, atol=1e-6)


def test_greedy_and_top_k_1_pick_the_argmax() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    greedy, greedy_lp = sample(logits, SamplingParams(max_new_tokens=1, temperature=0.0))
    top1, _ = sample(logits, SamplingParams(max_new_tokens=1, temperature=2.0, top_k=1))
    assert torch.equal(greedy, logits.argmax(-1)) and torch.equal(top1, greedy)
    torch.testing.assert_close(greedy_lp, torch.log_softmax(logits, -1).max(-1).values)  # temperature 0 -> 1


def test_token_logprobs_any_shape() -> None:
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(2))
    tokens = torch.tensor([[0, 6, 3], [2, 2, 5]])
    expected = torch.log_softmax(logits / 0.5, -1).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(token_logprobs(logits, tokens, 0.5), expected)
    assert token_logprobs(torch.zeros(1, 4), torch.tensor([1]))[0].item() == pytest.approx(-math.log(4))


def test_invalid_parameters_are_refused() -> None:
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}):
        with pytest.raises(ValueError):
            SamplingParams(max_new_tokens=4, **bad)
