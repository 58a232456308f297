"""Context-parallel sequence sharding: head-tail chunks, labels follow inputs, global positions."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from titanium.batch import Batch
from titanium.objectives.dpo import PreferenceFields
from titanium.parallel.context import headtail_indices, shard_batch


def test_headtail_chunks_cover_the_sequence_once():
    parts = [headtail_indices(16, 2, r).tolist() for r in range(2)]
    assert parts == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    assert sorted(sum((headtail_indices(24, 3, r).tolist() for r in range(3)), [])) == list(range(24))


def test_shard_batch_slices_the_core_and_per_token_fields():
    fields = PreferenceFields(
        labels=torch.arange(32).view(2, 16) + 100,
        response_ids=torch.zeros(2, 16, dtype=torch.long),
        pairs_per_row=torch.tensor([1, 0]),
    )
    batch = Batch(torch.arange(32).view(2, 16), fields)
    mesh = SimpleNamespace(size=lambda: 2, get_local_rank=lambda: 1)
    out = shard_batch(batch, mesh)
    assert out.tokens[0].tolist() == list(range(4, 12))
    assert out.fields.labels[1].tolist() == [116 + i for i in range(4, 12)]
    assert out.fields.pairs_per_row.tolist() == [1, 0]  # per row: whole
    assert out.positions.shape == (2, 8) and out.positions[1].tolist() == list(range(4, 12))
    assert out.fields.reference_logps is None
