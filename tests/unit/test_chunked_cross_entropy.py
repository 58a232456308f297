"""Chunked linear cross-entropy: the same loss and gradients as projecting everything, with far less memory.

References: ``F.cross_entropy`` on the full logits ``hidden @ weight.T`` (float32 and float64). Tolerances:
1e-5 relative in float32 (the chunked sums add the same terms in a different order), and bf16 rounding
(2e-2) under autocast.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import scalars, tiny_args
from titanium.batch import Batch
from titanium.config import load_config
from titanium.config.loader import ConfigError
from titanium.debug.memory import peak_memory_bytes
from titanium.objectives.base import IGNORE_INDEX, ModelOutput
from titanium.objectives.losses.cross_entropy import (
    TokenCrossEntropy,
    TokenFields,
    cross_entropy_sum,
    linear_cross_entropy_sum,
)
from titanium.parallel.distributed import shutdown_distributed


def _inputs(n: int, dim: int, vocab: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, dim, generator=g, dtype=dtype, requires_grad=True)
    weight = (torch.randn(vocab, dim, generator=g, dtype=dtype) * dim**-0.5).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=g)
    return hidden, weight, targets


def _reference(hidden, weight, targets, softcap=None):
    logits = (hidden @ weight.t()).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, targets, reduction="sum")


@pytest.mark.parametrize("softcap", [None, 1.5])  # (Gemma 2's final logit soft-capping; 1.5 caps these logits)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [1, 7, 37, 64])  # 37 tokens: chunks that divide, do not divide, exceed them
def test_loss_and_gradients_equal_the_full_projection(dtype, chunk, softcap):
    hidden, weight, targets = _inputs(37, 16, 101, dtype)
    expected = _reference(hidden, weight, targets, softcap)
    grad_h, grad_w = torch.autograd.grad(expected * 0.3, (hidden, weight))
    got = linear_cross_entropy_sum(hidden, weight, targets, chunk, softcap)
    got_h, got_w = torch.autograd.grad(got * 0.3, (hidden, weight))  # the incoming gradient is scaled through
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=0)
    torch.testing.assert_close(got_h, grad_h, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got_w, grad_w, rtol=1e-5, atol=1e-7)


def test_autocast_matmuls_run_in_bf16_like_nn_linear():
    hidden, weight, targets = _inputs(64, 32, 257)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")
        got = linear_cross_entropy_sum(hidden, weight, targets, 16)
    exact = _reference(hidden, weight, targets)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=0)  # the same bf16 logits, summed in another order
    assert not torch.equal(got, exact)  # (bf16 did change the numbers)
    torch.testing.assert_close(got, exact, rtol=2e-2, atol=0)
    grad_w = torch.autograd.grad(got, weight)[0]
    expected_w = torch.autograd.grad(expected, weight)[0]
    assert grad_w.dtype == torch.float32  # back to the parameter's dtype through the cast, as nn.Linear's
    # bf16 gradients; the chunked one is accumulated over 4 chunks in bf16, as a long matmul would be
    torch.testing.assert_close(grad_w, expected_w, rtol=2e-2, atol=2e-2 * expected_w.abs().max().item())


def _batch(rows: int = 3, seq: int = 20, vocab: int = 101, dim: int = 16):
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, vocab, (rows, seq), generator=g)
    labels[0, :5] = IGNORE_INDEX  # a prompt
    labels[2, -7:] = IGNORE_INDEX  # padding
    hidden = torch.randn(rows, seq, dim, generator=g, requires_grad=True)
    projection = torch.nn.Linear(dim, vocab, bias=False)
    return Batch(torch.zeros_like(labels), TokenFields(labels)), hidden, projection


def test_token_loss_drops_unlabelled_tokens_and_matches_the_logits_path():
    batch, hidden, projection = _batch()
    logits_loss = TokenCrossEntropy(0)(ModelOutput(logits=projection(hidden)), batch)
    expected = torch.autograd.grad(logits_loss, (hidden, projection.weight))
    assert logits_loss == cross_entropy_sum(projection(hidden), batch.fields.labels)
    chunked = TokenCrossEntropy(8)
    assert chunked.loss_input == "hidden" and TokenCrossEntropy(0).loss_input == "logits"
    (batch,) = chunked.prepare([batch])
    assert batch.fields.label_index.numel() == batch.units() == 60 - 12
    loss = chunked(ModelOutput(hidden=hidden, projection=projection), batch)
    got = torch.autograd.grad(loss, (hidden, projection.weight))
    torch.testing.assert_close(loss, logits_loss, rtol=1e-5, atol=0)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert got[0][0, :5].abs().sum() == 0  # prompt tokens got no gradient: they never reached the projection


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)],
)
def test_peak_memory_for_a_large_vocabulary_is_far_lower(device):
    """Forward and backward of 1024 tokens against a 32,768-token vocabulary: the full path holds [1024, 32768]
    float32 logits (128 MiB) and their gradient; 128-token chunks hold 1/8 of one of them at a time."""
    hidden, weight, targets = (t.detach().to(device).requires_grad_(t.requires_grad) for t in _inputs(1024, 64, 32768))

    def full():
        _reference(hidden, weight, targets).backward()

    def chunked():
        linear_cross_entropy_sum(hidden, weight, targets, 128).backward()

    full(), chunked()  # warm-up (CUDA: kernels and cuBLAS workspace)
    full_peak, chunked_peak = peak_memory_bytes(full, device), peak_memory_bytes(chunked, device)
    logits_bytes = 1024 * 32768 * 4
    assert full_peak >= 2 * logits_bytes  # logits and their gradient at once (measured: 384 MiB, 3x the logits)
    assert chunked_peak < full_peak / 8, (full_peak, chunked_peak)  # measured: 32 MiB, 12x less


def test_pipeline_parallelism_and_negative_sizes_are_config_errors(tmp_path):
    args = tiny_args(tmp_path, "--training.loss_chunk_size", "256")
    with pytest.raises(ConfigError, match="loss_chunk_size does not work with --parallelism.pipeline_parallel_degree"):
        load_config([*args, "--parallelism.pipeline_parallel_degree", "2"])
    with pytest.raises(ConfigError, match="loss_chunk_size must be >= 0"):
        load_config(tiny_args(tmp_path, "--training.loss_chunk_size", "-1"))


SFT = (
    "--training.objective", "sft",
    "--data.kind", "chat",
    "--data.path", "assets/tasks/arithmetic/train.jsonl",
    "--chat.chat_template", "llama3",
    "--training.steps", "3",
    "--debug.deterministic",
)  # fmt: skip


def test_sft_training_is_the_same_chunked(make_trainer, tmp_path):
    """Three SFT steps (packed rows, prompt tokens unlabelled) log the same losses and grad norms chunked."""
    runs = {}
    for name, chunk in (("full", "0"), ("chunked", "32")):
        trainer = make_trainer(*tiny_args(tmp_path / name, *SFT, "--training.loss_chunk_size", chunk))
        assert trainer.objective.loss_input == ("hidden" if chunk != "0" else "logits")
        trainer.train()
        trainer.close()
        shutdown_distributed()
        runs[name] = scalars(tmp_path / name / "tb"), scalars(tmp_path / name / "tb", "optim/grad_norm")
    (losses, norms), (ref_losses, ref_norms) = runs["chunked"], runs["full"]
    assert sorted(losses) == [1, 2, 3]
    for step in losses:
        assert losses[step] == pytest.approx(ref_losses[step], rel=1e-5)
        assert norms[step] == pytest.approx(ref_norms[step], rel=1e-5)


def test_a_converted_output_layer_is_refused():
    """The chunked loss uses the projection's weight alone: an adapter or float8 cast on it would be lost."""
    from titanium.config.sections import LoRASection
    from titanium.peft.lora import apply_lora

    batch, hidden, projection = _batch()
    model = nn.Module()
    model.output = projection
    apply_lora(model, LoRASection(rank=2, target_modules=["output"]))
    with pytest.raises(ConfigError, match="output layer is a LoRALinear"):
        TokenCrossEntropy(8)(
            ModelOutput(hidden=hidden, projection=model.output), TokenCrossEntropy(8).prepare([batch])[0]
        )
