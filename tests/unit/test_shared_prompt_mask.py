"""The parent-document mask of shared-prompt rows: a prompt once, two responses after it, each seeing the prompt and
itself. The rule (dense and FlexAttention forms) against one written out from the row's layout, and a model's hidden
states in such a row against each sequence run alone (fp32, 1e-5), with both attention kernels."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from titanium.data.preference import PreferencePair
from titanium.data.preference_rows import lay_row, shared_piece, shared_prefix
from titanium.data.sft import IGNORE_INDEX
from titanium.models import build_model_args, get_model_spec
from titanium.models.common.attention import document_causal_mask
from titanium.models.common.attention_kernels import document_block_mask
from titanium.parallel.context import chunk_masks, gather_order, headtail_indices

VOCAB = 300
SEQ_LEN = 64


def sequence(prompt: list[int], response: list[int]) -> dict[str, list[int]]:
    """A sample as the datasets make it: every response token learned (labels shifted, at the predicting column)."""
    tokens = prompt + response
    labels = [tokens[t + 1] if t + 1 >= len(prompt) else IGNORE_INDEX for t in range(len(tokens) - 1)]
    return {"tokens": tokens, "labels": labels + [IGNORE_INDEX]}


def random_pair(seed: int, prompt: int, chosen: int, rejected: int, shared: bool = True) -> PreferencePair:
    g = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(1, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    p = draw(prompt)
    other = p if shared else [(p[0] % (VOCAB - 2)) + 1] + p[1:]  # a different first token: nothing shared
    return PreferencePair(sequence(p, draw(chosen)), sequence(other, draw(rejected)), 0, seed)


PAIRS = [random_pair(0, 9, 4, 6), random_pair(1, 3, 7, 2), random_pair(2, 5, 3, 3, shared=False)]


def layout_mask(pairs: list[PreferencePair], width: int) -> torch.Tensor:
    """Which columns each column sees, written out from the layout: a prompt token the prompt up to itself, a
    response token the prompt and its own response up to itself, padding the padding at positions up to its own
    (they count from 0 again every SEQ_LEN columns: the model has SEQ_LEN positions)."""
    spans: list[list[int]] = []  # for every column: the columns of the sequence it belongs to
    start = 0
    for pair in pairs:
        s, n_chosen = shared_prefix(pair), len(pair.chosen["tokens"])
        prompt = list(range(start, start + s))
        chosen = list(range(start + s, start + n_chosen))
        rejected = list(range(start + n_chosen, start + n_chosen + len(pair.rejected["tokens"]) - s))
        spans += [prompt] * s + [prompt + chosen] * len(chosen) + [prompt + rejected] * len(rejected)
        start = rejected[-1] + 1
    mask = torch.zeros(width, width, dtype=torch.bool)
    for q, span in enumerate(spans):
        mask[q, [k for k in span if k <= q]] = True
    position = lambda column: (column - start) % SEQ_LEN  # noqa: E731
    for q in range(start, width):
        mask[q, [k for k in range(start, width) if position(k) <= position(q)]] = True
    return mask


def shared_row(pairs: list[PreferencePair], width: int) -> dict[str, torch.Tensor]:
    return lay_row([(shared_piece(pair, False), m, None) for m, pair in enumerate(pairs)], width, 0, SEQ_LEN)


def test_the_mask_rule_equals_the_layout_written_out_in_both_forms():
    assert [shared_prefix(pair) for pair in PAIRS] == [9, 3, 0]  # (the prompts; the last pair shares nothing)
    width = 160  # two FlexAttention blocks of 128, the second partly padding (2 x SEQ_LEN + 32 wide)
    row = shared_row(PAIRS, width)
    positions, documents, parents = (row[k][None] for k in ("positions", "document_ids", "parent_ids"))
    dense = document_causal_mask(positions, positions, documents, documents, q_parents=parents)[0, 0]
    assert torch.equal(dense, layout_mask(PAIRS, width))
    block_mask = document_block_mask(positions, positions, documents, documents, q_parents=parents)
    assert torch.equal(create_mask(block_mask.mask_mod, 1, 1, width, width, device="cpu")[0, 0], dense)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_chunk_masks_with_parents_equal_the_whole_row_mask(cp):
    """Each cp rank's query chunks (split head-tail, keys in gather order) see the keys of their rows of the whole
    row's mask, in both forms; the dense chunks, cut at each chunk's key limit, drop the keys after their query,
    which only padding sees (its positions start again at SEQ_LEN; no label is learned from it)."""
    width = 168  # (divided by 2 x cp for cp 2 and 3)
    row = shared_row(PAIRS, width)
    positions, documents, parents = (row[k][None] for k in ("positions", "document_ids", "parent_ids"))
    dense = document_causal_mask(positions, positions, documents, documents, q_parents=parents)[0, 0]
    padding = row["document_ids"] == row["document_ids"].max()
    sources = row["label_sources"][row["label"] != IGNORE_INDEX]
    assert padding[dense.triu(1).any(1)].all() and not padding[sources].any()
    gathered = gather_order(width, cp)
    for rank in range(cp):
        local = headtail_indices(width, cp, rank)
        want = dense[local]
        shards = (positions[:, local], positions[:, gathered], documents[:, local], documents[:, gathered])
        options = {"cp_size": cp, "cp_rank": rank, "parents": parents[:, local]}
        masks = {kernel: chunk_masks(*shards, kernel=kernel, **options) for kernel in ("sdpa", "flex")}
        flex_mask = masks["flex"].block_mask
        assert flex_mask is not None
        got = torch.zeros_like(want)
        got[:, gathered] = create_mask(flex_mask.mask_mod, 1, 1, len(local), width, device="cpu")[0, 0]
        assert torch.equal(got, want)
        state, chunk = masks["sdpa"], len(local) // 2
        assert state.order is not None and state.masks is not None
        assert torch.equal(gathered[state.order], torch.arange(state.key_limits[1]))  # (the row's first columns)
        for queries, mask, limit in zip((local[:chunk], local[chunk:]), state.masks, state.key_limits):
            assert torch.equal(mask[0, 0], dense[queries, :limit])


def model(name: str) -> torch.nn.Module:
    spec = get_model_spec(name)
    built = spec.model_cls(build_model_args(spec, "debugmodel", vocab_size=VOCAB, max_seq_len=SEQ_LEN))
    built.init_weights(seed=0)
    return built.eval()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(("name", "backend"), [("llama3", "sdpa"), ("qwen3", "sdpa"), ("qwen3", "flex")])
@torch.no_grad()
def test_a_shared_row_gives_each_sequence_its_hidden_states_alone(name, backend):
    """Every column of a shared row holds the hidden state of its token in its own sequence run alone (the
    rejected response's columns those of the rejected sequence after the prompt). FlexAttention runs forward only
    on CPU."""
    net = model(name)
    net.attention_backend = backend
    row = shared_row(PAIRS, 2 * SEQ_LEN)  # (as pad_to seq_len makes it: padding past SEQ_LEN positions too)
    inputs = {k: row[k][None] for k in ("positions", "document_ids", "parent_ids")}
    hidden = net(row["input"][None], **inputs, project=False)[0]
    start = 0
    for pair in PAIRS:
        s, n_chosen, n_rejected = shared_prefix(pair), len(pair.chosen["tokens"]), len(pair.rejected["tokens"])
        chosen, rejected = (net(torch.tensor([p["tokens"]]), project=False)[0] for p in (pair.chosen, pair.rejected))
        torch.testing.assert_close(hidden[start : start + n_chosen], chosen, rtol=1e-5, atol=1e-5)
        end = start + n_chosen + n_rejected - s
        torch.testing.assert_close(hidden[start + n_chosen : end], rejected[s:], rtol=1e-5, atol=1e-5)
        start = end
