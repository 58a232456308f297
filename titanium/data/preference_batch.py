"""Preference pairs -> microbatches that run chosen and rejected through the model in one forward.

A microbatch of B pairs is 2B rows, taken as B *row pairs* (rows 2g and 2g + 1), and every
preference pair lies whole inside one row pair. So any run of an even number of rows holds whole pairs:
a pipeline microbatch (a slice of rows) can compute the loss of its pairs with nothing from other rows.

Padded (default): row pair g holds pair g, its chosen sequence in row 2g and its rejected one in row
2g + 1, right-padded. Packed: pairs go first fit into the first row pair where both sequences fit, each
in the first of the two rows with room; each sequence is a document of its own, with positions
restarting and attention kept inside it, as in SFT packing. A row pair always has room for one more pair
of sequences (each at most seq_len), so a packed microbatch holds at least B pairs.

Rows are seq_len wide (``pad_to="seq_len"``, fixed shapes), or as wide as the microbatch's longest row
rounded up to a bucket (``pad_to="longest"``, titanium.data.packing.bucket_width): the same batch with the
padding columns that no row uses cut off. Causal attention never lets a token see the padding after it,
so every key (labels, response ids, reference values) and every result is the same either way; short pairs
just stop paying for seq_len.

Besides ``input``, ``label``, ``positions`` and ``document_ids`` (titanium.data.packing.make_row), a
batch carries, all row-aligned (first dimension 2B, second the width W):

- ``response_ids`` [2B, W]: ``2m + side`` where a label belongs to the m-th pair of its row pair
  (side 0: chosen, 1: rejected), -1 where there is no label. Summing token log-probs by it gives every
  pair's two response log-probs in either layout (titanium.trainers.dpo.response_sums).
- ``pairs_per_row`` [2B]: pairs whose chosen sequence is in the row (they add up to the pairs).
- ``reference_logps`` [2B, W] float32, only when the pairs carry cached reference log-probs: each
  response's value at its first label position, 0 elsewhere, so the same sums give the reference's.
- ``prompt_labels`` [2B, W], only when asked for (``prompt_labels=True``; ORPO's NLL is over the chosen
  sequence's prompt too): the next token at every position of a chosen sequence that has no label (its
  prompt and template tokens, all but its last position), IGNORE_INDEX elsewhere.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from titanium.data.packing import PadTo, bucket_width, make_row
from titanium.data.preference import PreferencePair
from titanium.data.sft import IGNORE_INDEX, Sample

Placement = tuple[PreferencePair, int, int]
"""A pair, its row pair g and its index m among the pairs of that row pair."""


class PairStream(Protocol):
    """A resumable iterable of PreferencePairs (titanium.data.preference.PreferenceDataset)."""

    def __iter__(self) -> Iterator[PreferencePair]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def pair_slots(seq_len: int, packing: bool) -> int:
    """How many pairs one row pair can hold: 1 padded; packed, seq_len // 2 (a sequence with a label has at
    least 2 tokens, so a pair takes at least 4 of the row pair's 2 x seq_len)."""
    return seq_len // 2 if packing else 1


def preference_batch(
    placements: list[Placement],
    row_pairs: int,
    rows_of: list[tuple[int, int]],
    seq_len: int,
    pad_id: int,
    pad_to: PadTo = "seq_len",
    pad_multiple: int = 8,
    prompt_labels: bool = False,
) -> dict[str, torch.Tensor]:
    """The batch of ``row_pairs`` row pairs holding ``placements``; ``rows_of[i]`` are the rows (0 or 1 in
    the row pair) of placement i's chosen and rejected sequences, filled in placement order. Its width is
    seq_len, or with ``pad_to="longest"`` the longest row's length rounded up by ``bucket_width``."""
    rows: list[list[tuple[Sample, int, float | None]]] = [[] for _ in range(2 * row_pairs)]
    chosen_rows = [0] * (2 * row_pairs)
    for (pair, g, m), (chosen_row, rejected_row) in zip(placements, rows_of):
        reference = pair.reference or (None, None)
        rows[2 * g + chosen_row].append((pair.chosen, 2 * m, reference[0]))
        rows[2 * g + rejected_row].append((pair.rejected, 2 * m + 1, reference[1]))
        chosen_rows[2 * g + chosen_row] += 1
    width = seq_len
    if pad_to == "longest":
        longest = max(sum(len(sample["tokens"]) for sample, _, _ in row) for row in rows)
        width = bucket_width(longest, seq_len, pad_multiple)
    made = [make_row([sample for sample, _, _ in row], width, pad_id) for row in rows]
    batch = {key: torch.stack([m[key] for m in made]) for key in made[0]}
    ids = torch.full((2 * row_pairs, width), -1, dtype=torch.long)
    reference = torch.zeros(2 * row_pairs, width)
    prompt = torch.full((2 * row_pairs, width), IGNORE_INDEX, dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for sample, rid, value in row:
            labels = torch.tensor(sample["labels"])
            learned = (labels != IGNORE_INDEX).nonzero().flatten() + start
            ids[r, learned] = rid
            if value is not None:
                reference[r, learned[0]] = value
            if prompt_labels and rid % 2 == 0:  # a chosen sequence: the next token where there is no label
                unlabeled = labels[:-1] == IGNORE_INDEX
                prompt[r, start : start + len(labels) - 1] = torch.where(
                    unlabeled, torch.tensor(sample["tokens"][1:]), IGNORE_INDEX
                )
            start += len(labels)
    if prompt_labels:
        batch["prompt_labels"] = prompt
    batch["response_ids"] = ids
    batch["pairs_per_row"] = torch.tensor(chosen_rows, dtype=torch.long)
    if placements and all(pair.reference is not None for pair, _, _ in placements):
        batch["reference_logps"] = reference
    return batch


class PreferenceBatchLoader:
    """Microbatches of preference pairs (padded or packed, see the module docstring); checkpointable.

    ``pad_to``/``pad_multiple``: the rows' width (see the module docstring and bucket_width). Keep "seq_len"
    where shapes must not change (pipeline parallelism); under tensor or context parallelism ``pad_multiple``
    must be a multiple of the tp degree and of 2 x cp. ``prompt_labels``: add that key (module docstring).
    Packing decides which pairs share a microbatch by seq_len alone, so the batches (and a resumed run's) are
    the same whatever the width.

    The state is the pair stream's position plus, when packing, the pair read but not placed yet (it
    opens the next microbatch), so a resumed run builds the very same batches. A finite stream ends
    with a last microbatch of fewer pairs (its other rows padding), then StopIteration.
    """

    def __init__(
        self,
        pairs: PairStream,
        pairs_per_batch: int,
        seq_len: int,
        pad_id: int,
        packing: bool,
        pad_to: PadTo = "seq_len",
        pad_multiple: int = 8,
        prompt_labels: bool = False,
    ) -> None:
        if pairs_per_batch < 1:
            raise ValueError(f"pairs_per_batch must be >= 1, got {pairs_per_batch}")
        if pad_to not in ("seq_len", "longest") or pad_multiple < 1:
            raise ValueError(f"pad_to must be seq_len or longest and pad_multiple >= 1, got {pad_to}, {pad_multiple}")
        self.pairs, self.pairs_per_batch, self.seq_len, self.pad_id = pairs, pairs_per_batch, seq_len, pad_id
        self.packing, self.pad_to, self.pad_multiple = packing, pad_to, pad_multiple
        self.prompt_labels = prompt_labels
        self.slots = pair_slots(seq_len, packing)
        """Pairs a row pair can hold: a batch has ``pairs_per_batch x slots`` pair slots."""
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

    def _place(self) -> tuple[list[Placement], list[tuple[int, int]]]:
        """This microbatch's pairs, each with its row pair, its index there and the rows of its two sides."""
        placements: list[Placement] = []
        rows_of: list[tuple[int, int]] = []
        if not self.packing:
            while len(placements) < self.pairs_per_batch and (pair := self._next_pair()) is not None:
                placements.append((pair, len(placements), 0))
                rows_of.append((0, 1))
            return placements, rows_of
        space = [self.seq_len] * (2 * self.pairs_per_batch)
        counts = [0] * self.pairs_per_batch
        while (pair := self._next_pair()) is not None:
            sizes = (len(pair.chosen["tokens"]), len(pair.rejected["tokens"]))
            fits = (
                (g, rows) for g in range(self.pairs_per_batch) if (rows := _first_fit(space[2 * g : 2 * g + 2], sizes))
            )
            found = next(fits, None)
            if found is None:
                self._pending = pair
                break
            g, (chosen_row, rejected_row) = found
            space[2 * g + chosen_row] -= sizes[0]
            space[2 * g + rejected_row] -= sizes[1]
            placements.append((pair, g, counts[g]))
            rows_of.append((chosen_row, rejected_row))
            counts[g] += 1
        return placements, rows_of

    def next_placed(self) -> tuple[dict[str, torch.Tensor], list[Placement]]:
        """The next microbatch and where each of its pairs is (for results read back per pair)."""
        placements, rows_of = self._place()
        if not placements:
            raise StopIteration  # only a finite stream ends
        batch = preference_batch(
            placements,
            self.pairs_per_batch,
            rows_of,
            self.seq_len,
            self.pad_id,
            self.pad_to,
            self.pad_multiple,
            self.prompt_labels,
        )
        return batch, placements

    def __next__(self) -> dict[str, torch.Tensor]:
        return self.next_placed()[0]

    def state_dict(self) -> dict[str, Any]:
        # The pending pair as one JSON string: DCP flattens nested containers into keys (see PackedDataset).
        pending = None if self._pending is None else self._pending.to_json()
        return {"pairs": self.pairs.state_dict(), "pending": json.dumps(pending)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pairs.load_state_dict(state["pairs"])
        pending = json.loads(state["pending"])
        self._pending = None if pending is None else PreferencePair.from_json(pending)
        self._stream = None  # restart the generator from the restored position


def _first_fit(space: list[int], sizes: tuple[int, int]) -> tuple[int, int] | None:
    """Rows of a row pair with ``space`` free tokens for two sequences, each in the first row with room."""
    space = list(space)
    placed = []
    for size in sizes:
        row = next((k for k, free in enumerate(space) if free >= size), None)
        if row is None:
            return None
        space[row] -= size
        placed.append(row)
    return placed[0], placed[1]
