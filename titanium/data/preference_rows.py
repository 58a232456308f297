"""How a preference pair's tokens lie in a row: each sequence on its own, or the prompt once with both responses.

A *piece* is what one placement puts into a row: one whole sequence (chosen or rejected, the separate layout),
or a *shared-prompt* piece: the prompt P the two sequences start with, then the chosen response C, then the
rejected response R. Chosen and rejected repeat the same prompt, and a DPO prompt is often most of a pair's
tokens, so the shared piece runs about half the tokens of the two sequences.

In a shared piece P, C and R are three documents; C and R have P as their *parent* document (the model's
``parent_ids``): a token sees the earlier tokens of its own document and the tokens of its parent at earlier
positions (titanium.models.common.attention.document_causal_mask). C's and R's positions both continue P's, so
every token of either response sees exactly what it sees in its own sequence, at the same RoPE positions: its
hidden state is the same.

Labels: in a sequence, the label at column t is the next token, predicted by the hidden state at t. In a
shared piece the first token of R is predicted by P's last hidden state, which also predicts C's first token,
so a shared piece puts every label at the column of the token it is (its target) and says in ``sources`` which
column's hidden state predicts it (the previous column; P's last one for R's first token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titanium.data.preference import PreferencePair
from titanium.data.sft import IGNORE_INDEX, Sample

CHOSEN, REJECTED, NO_SIDE = 0, 1, -1


@dataclass
class Piece:
    """Per-column lists of one placement's tokens as they lie in a row (all the same length)."""

    tokens: list[int]
    labels: list[int]
    """The token learned at this column (IGNORE_INDEX: none), predicted by the hidden state at ``sources``."""
    sources: list[int]
    """The piece column whose hidden state predicts the label here."""
    sides: list[int]
    """CHOSEN or REJECTED where ``labels`` has a label of that response, NO_SIDE elsewhere."""
    prompt_labels: list[int]
    """ORPO: the token of the chosen sequence predicted at this label place where it has no label; else IGNORE."""
    positions: list[int]
    documents: list[int]
    """Documents within the piece, from 0."""
    parents: list[int]
    """Each token's parent document within the piece (its own where it has none)."""


def sequence_piece(sample: Sample, side: int, prompt_labels: bool) -> Piece:
    """One sequence alone: labels at the predicting column, one document."""
    tokens, labels, n = sample["tokens"], sample["labels"], len(sample["tokens"])
    prompt = [IGNORE_INDEX] * n
    if prompt_labels:  # the next token where there is no label (not at the last column: nothing follows it)
        prompt = [
            tokens[t + 1] if t + 1 < n and label == IGNORE_INDEX else IGNORE_INDEX for t, label in enumerate(labels)
        ]
    sides = [NO_SIDE if label == IGNORE_INDEX else side for label in labels]
    return Piece(tokens, labels, list(range(n)), sides, prompt, list(range(n)), [0] * n, [0] * n)


def shared_prefix(pair: PreferencePair) -> int:
    """How many leading tokens the pair's two sequences share and learn nothing from except at the last one (whose
    label, the first response token, differs by side): the shared piece's prompt length."""
    chosen, rejected = pair.chosen, pair.rejected
    first_labels = (
        next((t for t, label in enumerate(s["labels"]) if label != IGNORE_INDEX), len(s["labels"]))
        for s in (chosen, rejected)
    )
    limit = min(first_labels) + 1
    common = 0
    for a, b in zip(chosen["tokens"][:limit], rejected["tokens"][:limit]):
        if a != b:
            break
        common += 1
    return common


def shared_length(pair: PreferencePair) -> int:
    """Tokens of the pair's shared piece: both sequences less the prompt once."""
    return len(pair.chosen["tokens"]) + len(pair.rejected["tokens"]) - shared_prefix(pair)


def shared_piece(pair: PreferencePair, prompt_labels: bool) -> Piece:
    """The pair's prompt once, then its chosen and rejected responses (see the module docstring): documents
    0 (prompt), 1 (chosen response) and 2 (rejected response), both responses with parent 0."""
    chosen, rejected = pair.chosen, pair.rejected
    s, n_chosen, n_rejected = shared_prefix(pair), len(chosen["tokens"]), len(rejected["tokens"])
    tokens = chosen["tokens"] + rejected["tokens"][s:]
    # each label moved to its target's column: rejected token t (t >= s) is learned from column t - 1, which is
    # the prompt's last column for t = s; with nothing shared (s = 0) its first token is learned from nothing
    labels = [IGNORE_INDEX] + chosen["labels"][:-1] + [IGNORE_INDEX] * (s == 0) + rejected["labels"][max(s - 1, 0) : -1]
    rejected_sources = [n_chosen + t - 1 - s if t > s else s - 1 if t else n_chosen for t in range(s, n_rejected)]
    sources = [max(t - 1, 0) for t in range(n_chosen)] + rejected_sources
    sides = [NO_SIDE if label == IGNORE_INDEX else int(t >= n_chosen) for t, label in enumerate(labels)]
    prompt = [IGNORE_INDEX] * len(tokens)
    if prompt_labels:  # the chosen sequence's tokens that no label learns, at their target column
        prompt[1:n_chosen] = [
            token if label == IGNORE_INDEX else IGNORE_INDEX
            for token, label in zip(chosen["tokens"][1:], chosen["labels"][:-1])
        ]
    positions = list(range(n_chosen)) + list(range(s, n_rejected))
    documents = [0] * s + [1] * (n_chosen - s) + [2] * (n_rejected - s)
    return Piece(tokens, labels, sources, sides, prompt, positions, documents, [0] * len(tokens))


def lay_row(
    pieces: list[tuple[Piece, int, tuple[float, float] | None]], width: int, pad_id: int, seq_len: int
) -> dict[str, torch.Tensor]:
    """One row of ``width`` columns holding ``pieces`` (each with its pair's index m in the row group and its cached
    reference log-probs), right-padded: padding is a document of its own, its positions counting from 0 and
    starting again at every ``seq_len`` (a shared-prompt row may be 2 x seq_len wide; the model has positions
    for seq_len; every padding token still sees itself).

    ``response_ids`` is ``2m + side`` at each label; ``reference_logps`` each response's reference value at its
    first label; ``pairs`` how many pieces hold a chosen label; ``label_sources`` the row column predicting each
    label (a piece's ``sources`` moved to where the piece starts).
    """
    row: dict[str, list[int]] = {k: [] for k in ("input", "label", "label_sources", "prompt_labels", "positions")}
    row.update(document_ids=[], parent_ids=[], response_ids=[])
    reference = [0.0] * width
    documents = pairs = 0
    for piece, m, values in pieces:
        start = len(row["input"])
        row["input"] += piece.tokens
        row["label"] += piece.labels
        row["label_sources"] += [start + source for source in piece.sources]
        row["prompt_labels"] += piece.prompt_labels
        row["positions"] += piece.positions
        row["document_ids"] += [documents + d for d in piece.documents]
        row["parent_ids"] += [documents + d for d in piece.parents]
        row["response_ids"] += [NO_SIDE if side == NO_SIDE else 2 * m + side for side in piece.sides]
        for side in (CHOSEN, REJECTED):
            if values is not None and side in piece.sides:
                reference[start + piece.sides.index(side)] = values[side]
        documents += max(piece.documents) + 1
        pairs += CHOSEN in piece.sides
    pad = width - len(row["input"])
    if pad < 0:
        raise ValueError(f"pieces of {len(row['input'])} tokens do not fit a row of {width}")
    fill = {"input": pad_id, "label": IGNORE_INDEX, "label_sources": 0, "prompt_labels": IGNORE_INDEX}
    fill.update(document_ids=documents, parent_ids=documents, response_ids=NO_SIDE)
    for key, values in row.items():
        values += [t % seq_len for t in range(pad)] if key == "positions" else [fill[key]] * pad
    tensors = {key: torch.tensor(values, dtype=torch.long) for key, values in row.items()}
    return {**tensors, "reference_logps": torch.tensor(reference), "pairs": torch.tensor(pairs)}
