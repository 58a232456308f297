"""The SFT objective end to end in one process: packing leaves each sample's loss and gradient unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO
from titanium.config.sections import DataSection, SFTSection
from titanium.data.chat import build_chat_template
from titanium.data.loader import collate
from titanium.data.packing import PackedDataset, make_row
from titanium.data.sft import SFTDataset
from titanium.data.tokenizer import ByteTokenizer, TiktokenTokenizer
from titanium.models import build_model_args, get_model_spec
from titanium.objectives.base import ModelOutput, ObjectiveContext
from titanium.objectives.losses.cross_entropy import cross_entropy_sum
from titanium.objectives.sft import SFTObjective

TOKENIZER = TiktokenTokenizer(str(REPO / "assets/tokenizer/titanium_debug.tiktoken"))
QUESTIONS = [("What is 2 + 3?", "5"), ("Reverse: cat", "tac"), ("Say hello twice.", "hello hello")] * 4


def _samples(tmp_path: Path, seq_len: int) -> list[dict]:
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in QUESTIONS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = build_chat_template("llama3", TOKENIZER, "llama3")
    dataset = SFTDataset(DataSection(kind="chat", path=str(path)), SFTSection(), TOKENIZER, template, seq_len)
    it = iter(dataset)
    return [next(it) for _ in QUESTIONS]


def _loss_and_grads(model: torch.nn.Module, rows: list[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-mean loss over all rows (sum / trainable count, the loop's rule) and its gradients."""
    model.zero_grad()
    batch = collate(rows)
    logits = model(batch["input"], positions=batch["positions"], document_ids=batch["document_ids"])
    count = (batch["label"] != -100).sum()
    loss = cross_entropy_sum(logits, batch["label"]) / count
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_packed_rows_give_the_unpacked_loss_and_gradients(tmp_path: Path) -> None:
    """Same 12 samples, packed into few rows vs one padded row each: loss and gradients agree (fp32, 1e-5)."""
    seq_len = 96
    samples = _samples(tmp_path, seq_len)
    padded = [make_row([sample], seq_len, TOKENIZER.pad_id) for sample in samples]
    packed = list(PackedDataset(iter(samples), seq_len, TOKENIZER.pad_id, buffer_size=8))  # a finite stream
    assert len(packed) < len(padded)  # packing really shared rows
    assert sum(int((r["label"] != -100).sum()) for r in packed) == sum(int((r["label"] != -100).sum()) for r in padded)

    spec = get_model_spec("llama3")
    torch.manual_seed(0)
    model = spec.model_cls(build_model_args(spec, "debugmodel", vocab_size=TOKENIZER.vocab_size, max_seq_len=seq_len))
    model.init_weights()
    packed_loss, packed_grads = _loss_and_grads(model, packed)
    padded_loss, padded_grads = _loss_and_grads(model, padded)
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-5, atol=0)
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, padded_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_rows_padded_to_the_longest_give_the_seq_len_loss_and_gradients(tmp_path: Path) -> None:
    """Unpacked SFT, --sft.pad_to longest vs seq_len on the same microbatches: narrower rows (bucketed), the same
    trainable tokens, loss and gradients (fp32, 1e-6), through the objective's own loss."""
    seq_len = 128
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in QUESTIONS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = get_model_spec("llama3")
    torch.manual_seed(0)
    model = spec.model_cls(build_model_args(spec, "debugmodel", vocab_size=TOKENIZER.vocab_size, max_seq_len=seq_len))
    model.init_weights()
    results = {}
    for pad_to in ("seq_len", "longest"):
        ctx = ObjectiveContext(TOKENIZER, "llama3", "llama3", TOKENIZER.vocab_size, seq_len, 4, 0, 1, seed=0)
        sft = SFTSection(packing=False, pad_to=pad_to)
        objective = SFTObjective(ctx, DataSection(kind="chat", path=str(path)), sft)
        batches = objective.prepare([objective.next_microbatch() for _ in range(3)]).batches
        units = sum(batch.fields.units() for batch in batches)
        model.zero_grad()
        loss = sum(
            objective.loss(ModelOutput(logits=model(**batch.model_inputs())), batch).loss_sum for batch in batches
        )
        (loss / units).backward()
        widths = [batch.tokens.shape[1] for batch in batches]
        results[pad_to] = (
            widths,
            int(units),
            loss.detach() / units,
            {n: p.grad.clone() for n, p in model.named_parameters()},
        )
    (full, full_units, full_loss, full_grads), (short, short_units, short_loss, short_grads) = results.values()
    assert full == [seq_len] * 3 and all(w < seq_len and w % 8 == 0 for w in short), short
    assert short_units == full_units
    torch.testing.assert_close(short_loss, full_loss, rtol=0, atol=1e-6)
    for name, grad in short_grads.items():
        torch.testing.assert_close(grad, full_grads[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("packing, expected_pct", [(False, 100 * 3 / 8), (True, 0.0)])
def test_padding_share_counts_padding_not_eos_standing_in_for_pad(tmp_path: Path, packing, expected_pct) -> None:
    """A tokenizer without a pad token pads with EOS; the real EOS ending each sample is not padding."""
    tokenizer = ByteTokenizer()
    tokenizer.pad_id = tokenizer.eos_id
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["abc", "xyz"]))  # BOS a b c EOS: 5 tokens
    seq_len = 8 if not packing else 10  # padded: 5 real + 3 padding; packed: two samples fill the row
    ctx = ObjectiveContext(tokenizer, "llama3", "llama3", tokenizer.vocab_size, seq_len, 2, 0, 1, seed=0)
    objective = SFTObjective(ctx, DataSection(kind="text", path=str(path)), SFTSection(packing=packing))
    batch = objective.next_microbatch()
    assert int((batch.tokens == tokenizer.eos_id).sum()) > (0 if packing else 6)  # EOS is everywhere
    assert objective.log_metrics()["data/padding_pct"] == pytest.approx(expected_pct)
