"""Batched greedy decoding with a KV cache gives exactly what naive one-prompt-at-a-time decoding gives."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titanium.generation.generate import greedy_generate, left_pad
from titanium.models.llama3 import LLAMA3_FLAVORS, Transformer

PAD = 0


def _model(seed: int = 0, **overrides: object) -> Transformer:
    """A tiny random Llama with a small vocabulary, so greedy paths vary and hit stop ids."""
    args = dataclasses.replace(
        LLAMA3_FLAVORS["debugmodel"], n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=32, max_seq_len=64
    )
    model = Transformer(dataclasses.replace(args, **overrides))
    torch.manual_seed(seed)
    model.init_weights()
    return model.eval()


@torch.no_grad()
def _naive(model: Transformer, prompt: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """Re-run the whole sequence for every token, one prompt alone, no cache, no masks."""
    seq, out = list(prompt), []
    for _ in range(max_new_tokens):
        token = int(model(torch.tensor([seq]))[0, -1].argmax())
        if token in stop_ids:
            break
        out.append(token)
        seq.append(token)
    return out


def _prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 32, (n,), generator=g).tolist() for n in (5, 1, 12, 8, 3)]


@pytest.mark.parametrize("tied", [False, True])
def test_batched_cached_greedy_equals_naive_greedy(tied: bool) -> None:
    model = _model(tie_word_embeddings=tied)
    prompts = _prompts()
    expected = [_naive(model, p, 10, set()) for p in prompts]
    assert len({tuple(e) for e in expected}) > 1, "degenerate test: every prompt continues the same way"
    assert greedy_generate(model, prompts, 10, set(), PAD) == expected


def test_stop_ids_cut_each_row_where_naive_stops() -> None:
    model = _model()
    prompts = _prompts()
    free = [_naive(model, p, 10, set()) for p in prompts]
    stop_ids = {free[0][2], free[2][4]}  # tokens that really occur, so some rows stop early
    expected = [_naive(model, p, 10, stop_ids) for p in prompts]
    assert any(len(e) < 10 for e in expected)
    assert greedy_generate(model, prompts, 10, stop_ids, PAD) == expected


def test_early_stop_runs_fewer_forwards_unless_the_ranks_disagree() -> None:
    model = _model()
    prompt = _prompts()[0]
    first = _naive(model, prompt, 1, set())[0]
    calls: list[int] = []
    model.register_forward_hook(lambda *_: calls.append(1))
    assert greedy_generate(model, [prompt], 8, {first}, PAD) == [[]]
    assert len(calls) == 1  # the prefill only
    calls.clear()
    assert greedy_generate(model, [prompt], 8, {first}, PAD, all_done=lambda _: False) == [[]]
    assert len(calls) == 8  # a prefill and one call per further token, as another rank would run


def test_padding_and_bounds() -> None:
    tokens, positions, document_ids = left_pad([[7, 8, 9], [5]], pad_id=PAD)
    assert tokens.tolist() == [[7, 8, 9], [PAD, PAD, 5]]
    assert positions.tolist() == [[0, 1, 2], [0, 0, 0]]
    assert document_ids.tolist() == [[1, 1, 1], [0, 0, 1]]
    model = _model()
    assert greedy_generate(model, [], 4, set(), PAD) == []
    assert greedy_generate(model, [[1, 2]], 0, set(), PAD) == [[]]
    with pytest.raises(ValueError, match="non-empty"):
        greedy_generate(model, [[1], []], 4, set(), PAD)
    with pytest.raises(ValueError, match="positions"):
        greedy_generate(model, [[1] * 60], 8, set(), PAD)
