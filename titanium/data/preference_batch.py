"""Preference pairs -> microbatches that run chosen and rejected through the model in one forward.

Padded (default): ``pairs_per_batch`` pairs (B) become 2B rows of seq_len, rows 0..B-1 the chosen
sequences and rows B..2B-1 the rejected ones, right-padded. Packed: the same 2B rows hold as many whole
pairs as fit (at least B: first fit can always place 2B sequences in 2B rows), each sequence a document
of its own, with positions restarting and attention kept inside it, as in SFT packing.

Besides ``input``, ``label``, ``positions`` and ``document_ids`` (titanium.data.packing.make_row), a
batch of P pairs carries:

- ``response_ids`` [rows, seq_len]: the response each label belongs to, pair j's chosen response is j
  and its rejected one P + j; -1 where there is no label. Summing token log-probs by this id gives the
  2P per-response log-probs, chosen first, in either layout (titanium.trainers.dpo.response_logps).
- ``response_lengths`` [2P]: label tokens per response (for length normalization); its shape gives 2P
  on any device without a sync.
- ``pair_rows`` [P, 2]: each pair's (source index, row) in the dataset: a key for cached reference
  log-probs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from titanium.data.packing import make_row
from titanium.data.preference import PreferencePair
from titanium.data.sft import IGNORE_INDEX, Sample

Row = list[tuple[Sample, int]]
"""The sequences of one row and the response id of each."""


class PairStream(Protocol):
    """A resumable iterable of PreferencePairs (titanium.data.preference.PreferenceDataset)."""

    def __iter__(self) -> Iterator[PreferencePair]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def preference_batch(
    rows: list[Row], pairs: list[PreferencePair], seq_len: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """Stack rows into one batch with the response bookkeeping described in the module docstring."""
    made = [make_row([sample for sample, _ in row], seq_len, pad_id) for row in rows]
    batch = {key: torch.stack([m[key] for m in made]) for key in made[0]}
    ids = []
    for row in rows:
        row_ids = [rid if label != IGNORE_INDEX else -1 for sample, rid in row for label in sample["labels"]]
        ids.append(row_ids + [-1] * (seq_len - len(row_ids)))
    batch["response_ids"] = torch.tensor(ids, dtype=torch.long)
    sides = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    lengths = [sum(label != IGNORE_INDEX for label in s["labels"]) for s in sides]
    batch["response_lengths"] = torch.tensor(lengths, dtype=torch.long)
    batch["pair_rows"] = torch.tensor([[p.source, p.row] for p in pairs], dtype=torch.long).view(-1, 2)
    return batch


def _first_fit(space: list[int], sizes: tuple[int, int]) -> list[int] | None:
    """Rows for two sequences, each in the first row with room, or None if either does not fit."""
    space = list(space)
    placed = []
    for size in sizes:
        row = next((k for k, free in enumerate(space) if free >= size), None)
        if row is None:
            return None
        space[row] -= size
        placed.append(row)
    return placed


class PreferenceBatchLoader:
    """Microbatches of preference pairs (padded or packed, see the module docstring); checkpointable.

    The state is the pair stream's position plus, when packing, the pair read but not placed yet (it
    opens the next microbatch), so a resumed run builds the very same batches.
    """

    def __init__(self, pairs: PairStream, pairs_per_batch: int, seq_len: int, pad_id: int, packing: bool) -> None:
        if pairs_per_batch < 1:
            raise ValueError(f"pairs_per_batch must be >= 1, got {pairs_per_batch}")
        self.pairs, self.pairs_per_batch, self.seq_len, self.pad_id = pairs, pairs_per_batch, seq_len, pad_id
        self.packing = packing
        self._stream: Iterator[PreferencePair] | None = None
        self._pending: PreferencePair | None = None

    def __iter__(self) -> PreferenceBatchLoader:
        return self

    def _next_pair(self) -> PreferencePair | None:
        if self._pending is not None:
            pair, self._pending = self._pending, None
            return pair
        if self._stream is None:
            self._stream = iter(self.pairs)
        return next(self._stream, None)

    def _padded(self) -> tuple[list[Row], list[PreferencePair]]:
        pairs = []
        while len(pairs) < self.pairs_per_batch and (pair := self._next_pair()) is not None:
            pairs.append(pair)
        n = len(pairs)
        rows = [[(p.chosen, j)] for j, p in enumerate(pairs)] + [[(p.rejected, n + j)] for j, p in enumerate(pairs)]
        return rows, pairs

    def _packed(self) -> tuple[list[Row], list[PreferencePair]]:
        n_rows = 2 * self.pairs_per_batch
        space = [self.seq_len] * n_rows
        placements: list[tuple[PreferencePair, list[int]]] = []
        while (pair := self._next_pair()) is not None:
            placed = _first_fit(space, (len(pair.chosen["tokens"]), len(pair.rejected["tokens"])))
            if placed is None:
                self._pending = pair
                break
            for row, sample in zip(placed, (pair.chosen, pair.rejected)):
                space[row] -= len(sample["tokens"])
            placements.append((pair, placed))
        n = len(placements)
        rows: list[Row] = [[] for _ in range(n_rows)]
        for j, (pair, (chosen_row, rejected_row)) in enumerate(placements):
            rows[chosen_row].append((pair.chosen, j))
            rows[rejected_row].append((pair.rejected, n + j))
        return rows, [pair for pair, _ in placements]

    def __next__(self) -> dict[str, torch.Tensor]:
        rows, pairs = self._packed() if self.packing else self._padded()
        if not pairs:
            raise StopIteration  # only a finite stream ends
        return preference_batch(rows, pairs, self.seq_len, self.pad_id)

    def state_dict(self) -> dict[str, Any]:
        # The pending pair as one JSON string: DCP flattens nested containers into keys (see PackedDataset).
        pending = None if self._pending is None else self._pending.to_json()
        return {"pairs": self.pairs.state_dict(), "pending": json.dumps(pending)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pairs.load_state_dict(state["pairs"])
        pending = json.loads(state["pending"])
        self._pending = None if pending is None else PreferencePair.from_json(pending)
        self._stream = None  # restart the generator from the restored position
