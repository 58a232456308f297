"""Document-aware attention: a packed row behaves exactly like its samples run one by one."""

from __future__ import annotations

import pytest
import torch

from titanium.models import build_model_args, get_model_spec
from titanium.models.common.attention import document_causal_mask
from titanium.objectives.losses.cross_entropy import cross_entropy_sum


def _model(name: str) -> torch.nn.Module:
    spec = get_model_spec(name)
    args = build_model_args(spec, "debugmodel", vocab_size=300, max_seq_len=64)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights()
    return model


def test_mask_rule() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    documents = torch.tensor([[0, 0, 0, 1, 1, 2]])
    mask = document_causal_mask(positions, positions, documents, documents)[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_packed_row_equals_separate_samples(name: str) -> None:
    """Logits, loss sum and gradients of a packed row match the samples run alone (fp32, 1e-5)."""
    model = _model(name)
    lengths = [11, 5, 9]
    samples = [torch.randint(0, 300, (1, n)) for n in lengths]
    labels = [torch.cat([s[:, 1:], torch.full((1, 1), -100)], dim=1) for s in samples]

    separate_logits, separate_loss = [], torch.zeros(())
    for tokens, label in zip(samples, labels):
        logits = model(tokens)
        separate_logits.append(logits)
        separate_loss = separate_loss + cross_entropy_sum(logits, label)
    separate_loss.backward()
    separate_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    tokens = torch.cat(samples, dim=1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    packed_logits = model(tokens, positions=positions, document_ids=documents)
    packed_loss = cross_entropy_sum(packed_logits, torch.cat(labels, dim=1))
    packed_loss.backward()

    torch.testing.assert_close(packed_logits, torch.cat(separate_logits, dim=1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed_loss, separate_loss, rtol=1e-6, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, separate_grads[n], rtol=1e-5, atol=1e-5, msg=n)


def test_plain_causal_unchanged_by_single_document() -> None:
    """One document spanning the row gives the same logits as the default causal path."""
    model = _model("llama3")
    tokens = torch.randint(0, 300, (2, 16))
    positions = torch.arange(16).expand(2, -1)
    documents = torch.zeros(2, 16, dtype=torch.long)
    torch.testing.assert_close(model(tokens, positions=positions, document_ids=documents), model(tokens))
