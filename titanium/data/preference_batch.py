"""Preference pairs -> microbatches that run chosen and rejected through the model in one forward.

A microbatch of B pairs is 2B rows, taken as B *row pairs* (rows 2g and 2g + 1), and every
preference pair lies whole inside one row pair. So any run of an even number of rows holds whole pairs:
a pipeline microbatch (a slice of rows) can compute the loss of its pairs with nothing from other rows.

Shared-prompt rows (``shared=True``, what DPO uses where it can, titanium/data/preference_rows.py): a row
holds a pair's prompt once and both responses after it, the responses masked from each other; a microbatch
of B pairs is then B rows of at most 2 x seq_len, each row a *row group* of its own (separate sequences: a
row pair is the row group). Padded, row g holds pair g; packed, pairs go first fit into the first row with
room. Everything below holds for them with "row pair" read as "row group".

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
  pair's two response log-probs in either layout (titanium.objectives.dpo.response_sums).
- ``pairs_per_row`` [2B]: pairs whose chosen sequence is in the row (they add up to the pairs).
- ``reference_logps`` [2B, W] float32, only when the pairs carry cached reference log-probs: each
  response's value at its first label position, 0 elsewhere, so the same sums give the reference's.
- ``parent_ids`` and ``label_sources`` [rows, W], only in shared-prompt rows: each token's parent document
  (the model's ``parent_ids``), and for each label the column whose hidden state predicts it (a shared row
  puts each label at its target's column, titanium/data/preference_rows.py).
- image fields (``titanium.data.vision.image_rows``' ``image.*`` entries), only for an image-text model's pairs
  (``layout``; padded separate sequences only): each side's images and per-token image fields in its row.
- ``prompt_labels`` [2B, W], only when asked for (``prompt_labels=True``; ORPO's NLL is over the chosen
  sequence's prompt too): the next token at every position of a chosen sequence that has no label (its
  prompt and template tokens, all but its last position), IGNORE_INDEX elsewhere.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from titanium.data.packing import PadTo, bucket_width
from titanium.data.preference import PreferencePair
from titanium.data.preference_rows import CHOSEN, REJECTED, Piece, lay_row, sequence_piece, shared_length, shared_piece
from titanium.data.vision import ProcessorLayout, image_rows

Placement = tuple[PreferencePair, int, int]
"""A pair, its row pair g and its index m among the pairs of that row pair."""


class PairStream(Protocol):
    """A resumable iterable of PreferencePairs (titanium.data.preference.PreferenceDataset)."""

    def __iter__(self) -> Iterator[PreferencePair]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def pair_slots(seq_len: int, packing: bool, shared: bool = False) -> int:
    """How many pairs one row group can hold: 1 padded; packed, seq_len // 2 in a row pair (a sequence with a
    label has at least 2 tokens, so a pair takes at least 4 of the row pair's 2 x seq_len), 2 x seq_len // 3 in a
    shared-prompt row (a shared piece has at least 3 tokens)."""
    if not packing:
        return 1
    return 2 * seq_len // 3 if shared else seq_len // 2


def group_rows(shared: bool) -> int:
    """Rows per row group: 2 (a row pair) for separate sequences, 1 for shared-prompt rows."""
    return 1 if shared else 2


def preference_batch(
    placements: list[Placement],
    groups: int,
    rows_of: list[tuple[int, int]] | None,
    seq_len: int,
    pad_id: int,
    pad_to: PadTo = "seq_len",
    pad_multiple: int = 8,
    prompt_labels: bool = False,
) -> dict[str, torch.Tensor]:
    """The batch of ``groups`` row groups holding ``placements``. ``rows_of[i]`` are the rows (0 or 1 in the
    row pair) of placement i's chosen and rejected sequences, filled in placement order; None: shared-prompt
    rows (one row a group, a piece per pair). Its width is the row capacity (seq_len, 2 x seq_len shared), or
    with ``pad_to="longest"`` the longest row's length rounded up by ``bucket_width``."""
    shared = rows_of is None
    rows: list[list[tuple[Piece, int, tuple[float, float] | None]]] = [[] for _ in range(groups * group_rows(shared))]
    for i, (pair, g, m) in enumerate(placements):
        if rows_of is None:
            rows[g].append((shared_piece(pair, prompt_labels), m, pair.reference))
            continue
        chosen_row, rejected_row = rows_of[i]
        rows[2 * g + chosen_row].append((sequence_piece(pair.chosen, CHOSEN, prompt_labels), m, pair.reference))
        rows[2 * g + rejected_row].append((sequence_piece(pair.rejected, REJECTED, False), m, pair.reference))
    width = row_capacity(seq_len, shared)
    if pad_to == "longest":
        longest = max(sum(len(piece.tokens) for piece, _, _ in row) for row in rows)
        width = bucket_width(longest, width, pad_multiple)
    made = [lay_row(row, width, pad_id, seq_len) for row in rows]
    batch = {key: torch.stack([m[key] for m in made]) for key in made[0]}
    batch["pairs_per_row"] = batch.pop("pairs")
    if not prompt_labels:
        del batch["prompt_labels"]
    if not shared:  # (one document per sequence, each label at its predicting column)
        del batch["parent_ids"], batch["label_sources"]
    if not placements or any(pair.reference is None for pair, _, _ in placements):
        del batch["reference_logps"]
    return batch


def pair_image_rows(
    placements: list[Placement], groups: int, width: int, layout: ProcessorLayout
) -> dict[str, torch.Tensor]:
    """The image fields of padded row pairs (row 2g the chosen side of pair g, 2g + 1 its rejected side; rows without a
    pair get padding), each side's as its sample carries them (titanium.data.vision_preference)."""
    samples: list[dict] = [{} for _ in range(2 * groups)]
    for pair, g, _ in placements:
        samples[2 * g], samples[2 * g + 1] = pair.chosen, pair.rejected
    return image_rows(samples, width, layout)


def row_capacity(seq_len: int, shared: bool) -> int:
    """Tokens a row holds: seq_len, or 2 x seq_len for shared-prompt rows (a row group's tokens, as a row pair's)."""
    return 2 * seq_len if shared else seq_len


class PreferenceBatchLoader:
    """Microbatches of preference pairs (padded or packed, see the module docstring); checkpointable.

    ``pad_to``/``pad_multiple``: the rows' width (see the module docstring and bucket_width). Keep "seq_len"
    where shapes must not change (pipeline parallelism); under tensor or context parallelism ``pad_multiple``
    must be a multiple of the tp degree and of 2 x cp. ``prompt_labels``: add that key (module docstring).
    ``layout``: the processor's (an image-text model's pairs, padded separate sequences only): add the image fields.
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
        shared: bool = False,
        layout: ProcessorLayout | None = None,
    ) -> None:
        if layout is not None and (packing or shared):
            raise ValueError("pairs with images are laid one sequence a row, padded (neither packed nor shared)")
        if pairs_per_batch < 1:
            raise ValueError(f"pairs_per_batch must be >= 1, got {pairs_per_batch}")
        if pad_to not in ("seq_len", "longest") or pad_multiple < 1:
            raise ValueError(f"pad_to must be seq_len or longest and pad_multiple >= 1, got {pad_to}, {pad_multiple}")
        self.pairs, self.pairs_per_batch, self.seq_len, self.pad_id = pairs, pairs_per_batch, seq_len, pad_id
        self.packing, self.pad_to, self.pad_multiple = packing, pad_to, pad_multiple
        self.prompt_labels, self.shared, self.layout = prompt_labels, shared, layout
        self.slots = pair_slots(seq_len, packing, shared)
        """Pairs a row group can hold: a batch has ``pairs_per_batch x slots`` pair slots."""
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

    def _place(self) -> tuple[list[Placement], list[tuple[int, int]] | None]:
        """This microbatch's pairs, each with its row group, its index there and (separate sequences) the rows of
        its two sides in the row pair."""
        placements: list[Placement] = []
        rows_of: list[tuple[int, int]] = []
        if not self.packing:
            while len(placements) < self.pairs_per_batch and (pair := self._next_pair()) is not None:
                placements.append((pair, len(placements), 0))
                rows_of.append((0, 1))
            return placements, None if self.shared else rows_of
        rows = group_rows(self.shared)
        space = [row_capacity(self.seq_len, self.shared)] * (rows * self.pairs_per_batch)
        counts = [0] * self.pairs_per_batch
        while (pair := self._next_pair()) is not None:
            sizes = (
                (shared_length(pair),) if self.shared else (len(pair.chosen["tokens"]), len(pair.rejected["tokens"]))
            )
            fits = (
                (g, fit)
                for g in range(self.pairs_per_batch)
                if (fit := _first_fit(space[rows * g : rows * g + rows], sizes))
            )
            found = next(fits, None)
            if found is None:
                self._pending = pair
                break
            g, placed = found
            for row, size in zip(placed, sizes):
                space[rows * g + row] -= size
            placements.append((pair, g, counts[g]))
            rows_of.append((placed[0], placed[-1]))
            counts[g] += 1
        return placements, None if self.shared else rows_of

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
        if self.layout is not None:
            batch.update(pair_image_rows(placements, self.pairs_per_batch, batch["input"].shape[1], self.layout))
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


def _first_fit(space: list[int], sizes: tuple[int, ...]) -> list[int] | None:
    """Rows of a row group with ``space`` free tokens for pieces of ``sizes``, each in the first row with room."""
    space = list(space)
    placed = []
    for size in sizes:
        row = next((k for k, free in enumerate(space) if free >= size), None)
        if row is None:
            return None
        space[row] -= size
        placed.append(row)
    return placed
