"""Preference batches trimmed to their longest row (pad_to="longest"): bucket widths, the same keys as the
seq_len-wide batch minus padding columns, and exactly the DPO loss and gradients of the untrimmed batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titanium.config.sections import DPOSection
from titanium.data.packing import bucket_width, padding_mask
from titanium.data.preference import PreferencePair, pair_sample
from titanium.data.preference_batch import PreferenceBatchLoader
from titanium.data.sft import IGNORE_INDEX
from titanium.objectives.dpo import response_sums, token_logps
from titanium.objectives.losses.dpo import dpo_loss

SEQ_LEN = 60  # not a multiple of the buckets: the cap at seq_len is exercised
VOCAB = 64
PAD = 0
ROW_KEYS = ("input", "label", "positions", "document_ids", "response_ids", "reference_logps")


def make_pairs(lengths: list[tuple[int, int, int]], seed: int = 0) -> list[PreferencePair]:
    """Pairs of (prompt, chosen, rejected) lengths with random ids and cached reference values."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for k, (p, c, r) in enumerate(lengths):
        prompt = torch.randint(1, VOCAB, (p,), generator=g).tolist()
        sides = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (c, r)]
        samples = [pair_sample(prompt, (ids, [True] * len(ids))) for ids in sides]
        reference = (-float(c) - k / 10, -float(r) - k / 7)
        pairs.append(PreferencePair(samples[0], samples[1], 0, k, reference))
    return pairs


SHORT = [(5, 3, 7), (8, 9, 2), (4, 1, 12), (6, 6, 6), (3, 10, 4), (9, 2, 3), (7, 5, 8)]
MIXED = [(18, 20, 6), (20, 5, 15), (6, 4, 4), (22, 14, 16), (5, 3, 3), (16, 22, 9), (4, 2, 5)]
"""Packed 3 pairs per batch: a first batch of full rows, then a last one of 2 pairs, 3 documents in a row."""


def batches(pairs: list[PreferencePair], packing: bool, pad_to: str, pairs_per_batch: int = 3) -> list[dict]:
    return list(PreferenceBatchLoader(iter(pairs), pairs_per_batch, SEQ_LEN, PAD, packing, pad_to))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("longest", "seq_len", "multiple", "width"),
    [
        (1, 2048, 8, 8),
        (8, 2048, 8, 8),
        (9, 2048, 8, 16),
        (33, 2048, 8, 40),
        (36, 2048, 8, 40),
        (41, 2048, 8, 48),
        (64, 2048, 8, 64),
        (65, 2048, 8, 80),  # (64, 128]: multiples of 16
        (600, 2048, 8, 640),  # (512, 1024]: multiples of 128
        (1100, 2048, 8, 1280),
        (2048, 2048, 8, 2048),
        (50, 60, 8, 56),
        (57, 60, 8, 60),  # the bucket (64) is past seq_len: seq_len itself
        (60, 60, 8, 60),
        (36, 64, 6, 48),  # every width divides by pad_multiple (lcm with the bucket step: 24)
        (5, 64, 1, 5),  # up to 8 tokens, a step of 1
    ],
)
def test_bucket_width(longest, seq_len, multiple, width):
    assert bucket_width(longest, seq_len, multiple) == width


def test_bucket_width_few_widths_bounded_padding():
    widths = [bucket_width(n, 2048) for n in range(1, 2049)]
    assert len(set(widths)) == 28 and all(w % 8 == 0 for w in widths)
    assert all(w - n <= max(7, n // 4) for n, w in zip(range(1, 2049), widths))
    with pytest.raises(ValueError, match="no width"):
        bucket_width(61, 60)
    with pytest.raises(ValueError, match="pad_to"):
        PreferenceBatchLoader(iter([]), 2, SEQ_LEN, PAD, False, "batch")  # type: ignore[arg-type]


@pytest.mark.parametrize("packing", [False, True])
def test_trimmed_batches_are_the_full_batches_without_padding_columns(packing):
    """Same batches, same pairs; every row-aligned key is the seq_len-wide one cut at the bucket width, and
    what is cut is padding only (no label, no response, no reference value)."""
    pairs = make_pairs(MIXED if packing else SHORT * 3, seed=1)
    full, trimmed = batches(pairs, packing, "seq_len"), batches(pairs, packing, "longest")
    assert len(full) == len(trimmed) > 1 and any(b["input"].shape[1] < SEQ_LEN for b in trimmed)
    for a, b in zip(full, trimmed):
        assert a.keys() == b.keys() and set(ROW_KEYS) <= set(a)
        longest = int((~padding_mask(a)).sum(dim=1).max())
        width = b["input"].shape[1]
        assert width == bucket_width(longest, SEQ_LEN)
        for key in ROW_KEYS:
            assert torch.equal(b[key], a[key][:, :width]), key
        assert torch.equal(a["pairs_per_row"], b["pairs_per_row"])
        cut = {key: a[key][:, width:] for key in ROW_KEYS}
        assert (cut["label"] == IGNORE_INDEX).all() and (cut["response_ids"] == -1).all()
        assert (cut["reference_logps"] == 0).all() and padding_mask(a)[:, width:].all()


def test_a_pair_exactly_at_seq_len_keeps_the_full_width():
    pairs = make_pairs([(20, SEQ_LEN - 20, 5), (4, 3, 2)])
    for packing in (False, True):
        (full,), (trimmed,) = batches(pairs, packing, "seq_len"), batches(pairs, packing, "longest")
        assert trimmed["input"].shape[1] == SEQ_LEN
        assert all(torch.equal(full[k], trimmed[k]) for k in full)


def tiny_decoder(seed: int) -> torch.nn.Module:
    from titanium.models import build_model_args, get_model_spec

    spec = get_model_spec("llama3")
    args = build_model_args(spec, "debugmodel", vocab_size=VOCAB, max_seq_len=SEQ_LEN)
    args = dataclasses.replace(args, n_layers=2, dim=64, n_heads=4, n_kv_heads=2)
    torch.manual_seed(seed)
    model = spec.model_cls(args)
    model.init_weights(seed=seed)
    return model


def dpo_step(policy, reference, batch: dict, slots: int, cfg: DPOSection, cached: bool):
    """The DPO objective's loss on one batch (reference from the batch's cache or a no-grad forward), and its
    gradients: the per-token values summed per response by response_ids, then dpo_loss on the pair slots."""

    def forward(model) -> torch.Tensor:
        return model(batch["input"], positions=batch["positions"], document_ids=batch["document_ids"])

    ids = batch["response_ids"]
    if cached:
        ref_tokens = batch["reference_logps"]
    else:
        with torch.no_grad():
            ref_tokens = token_logps(forward(reference), batch["label"])
    policy.zero_grad()
    per_token = torch.stack([token_logps(forward(policy), batch["label"]), ref_tokens, (ids >= 0).float()])
    policy_sums, reference_sums, lengths = response_sums(per_token, ids, slots).unbind(0)
    present = lengths[:, 0] > 0
    out = dpo_loss(*policy_sums.unbind(1), *reference_sums.unbind(1), cfg, *lengths.unbind(1), mask=present)
    loss = out.losses.sum() / present.sum()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in policy.named_parameters()}
    return loss.detach(), out.metrics, grads


@pytest.mark.parametrize("cached", [False, True], ids=["online_reference", "cached_reference"])
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_trimmed_batches_give_the_same_loss_and_gradients(packing, cached):
    policy, reference = tiny_decoder(0), tiny_decoder(1)
    cfg = DPOSection(beta=0.5, rpo_alpha=0.3)  # the RPO term uses the response lengths too
    pairs, per_batch = make_pairs(MIXED if packing else SHORT, seed=1), 3 if packing else 4
    slots = PreferenceBatchLoader(iter(pairs), per_batch, SEQ_LEN, PAD, packing).slots  # type: ignore[arg-type]
    full, trimmed = batches(pairs, packing, "seq_len", per_batch)[-1], batches(pairs, packing, "longest", per_batch)[-1]
    assert trimmed["input"].shape[1] < SEQ_LEN and (not packing or trimmed["document_ids"].max() > 1)
    loss, metrics, grads = dpo_step(policy, reference, trimmed, slots, cfg, cached)
    expected_loss, expected_metrics, expected_grads = dpo_step(policy, reference, full, slots, cfg, cached)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
    for name in expected_metrics:
        torch.testing.assert_close(metrics[name], expected_metrics[name], rtol=1e-6, atol=1e-5, msg=name)
    for name in expected_grads:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(g.abs().max() > 1e-3 for g in grads.values())  # a real gradient, not a vacuous match
