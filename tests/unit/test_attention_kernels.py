"""Attention without dense masks: every kernel equals an explicit float64 softmax over the masked scores.

The reference repeats K/V heads explicitly (the kernels get the grouped heads as they are) and masks with
``document_causal_mask``. Tolerances: float32 kernels vs the float64 reference, 1e-5 absolute and relative on
values and gradients (measured ~1e-7); flex vs SDPA forward on CPU, 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from titanium.models.common.attention import document_causal_mask
from titanium.models.common.attention_kernels import (
    PLAIN_SCORES,
    Scores,
    document_block_mask,
    flex,
    masked_kernel,
    sdpa,
)
from titanium.parallel.context import chunk_masks, headtail_indices

B, H, H_KV, D = 2, 4, 2, 16


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scores: Scores = PLAIN_SCORES
) -> torch.Tensor:
    """softmax(cap(q k^T * scale) masked) v in float64 over ``[B, S, H, D]`` tensors, K/V repeated to H heads;
    scale 1 / sqrt(D) and no cap unless ``scores`` says otherwise."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    logits = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scores.scale is None else scores.scale)
    if scores.softcap is not None:
        logits = torch.tanh(logits / scores.softcap) * scores.softcap
    return (logits.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(1, 2)


def _packed(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and document ids ``[2, sum(lengths)]`` of packed documents (row 1 in reverse order)."""
    rows = [lengths, lengths[::-1]]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    documents = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in rows])
    return positions, documents


def _qkv(seq: int, grad: bool = True, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, seq, H, D, generator=g).requires_grad_(grad)
    k = torch.randn(B, seq, H_KV, D, generator=g).requires_grad_(grad)
    v = torch.randn(B, seq, H_KV, D, generator=g).requires_grad_(grad)
    return q, k, v


def _values_and_grads(out: torch.Tensor, *inputs: torch.Tensor) -> list[torch.Tensor]:
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    return [out, *torch.autograd.grad(out, inputs, cotangent)]


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("documents", [False, True])
def test_sdpa_with_grouped_heads_equals_the_masked_reference(documents: bool) -> None:
    """The CPU path: causal SDPA (no mask) or the dense document mask, K/V never repeated."""
    positions, document_ids = _packed([7, 20, 5])
    if not documents:  # one document: plain causal
        positions, document_ids = torch.arange(32).expand(B, -1), torch.zeros_like(document_ids)
    mask = document_causal_mask(positions, positions, document_ids, document_ids)
    q, k, v = _qkv(positions.shape[1])
    got = _values_and_grads(sdpa(q, k, v, mask if documents else None), q, k, v)
    want = _values_and_grads(_reference(q, k, v, mask), q, k, v)
    _assert_close(got, want)


def test_block_mask_matches_the_dense_mask_block_by_block() -> None:
    """The flex path's BlockMask (built on CPU): token rule, partial blocks and full blocks all agree with
    ``document_causal_mask``; so the blocks it skips are exactly the fully masked ones."""
    positions, documents = _packed([130, 40, 200, 142])  # 512 tokens: 4 x 4 blocks of 128
    dense = document_causal_mask(positions, positions, documents, documents)
    block_mask = document_block_mask(positions, positions, documents, documents)
    seq, nb = positions.shape[1], positions.shape[1] // 128

    tokens = create_mask(block_mask.mask_mod, B, 1, seq, seq, device="cpu")
    assert torch.equal(tokens, dense)
    blocks = dense.view(B, 1, nb, 128, nb, 128)
    any_visible, all_visible = blocks.any(dim=(3, 5)), blocks.all(dim=(3, 5))
    assert torch.equal(block_mask.to_dense().bool(), any_visible)
    full = torch.zeros_like(all_visible)
    assert block_mask.full_kv_num_blocks is not None and block_mask.full_kv_indices is not None
    for b in range(B):
        for row in range(nb):
            count = int(block_mask.full_kv_num_blocks[b, 0, row])
            full[b, 0, row, block_mask.full_kv_indices[b, 0, row, :count]] = True
    assert torch.equal(full, all_visible)
    assert not any_visible.all()  # the case has skipped blocks


def test_block_mask_of_context_parallel_queries_over_gathered_keys() -> None:
    """The CP form: one rank's head-tail queries over keys in gather order, against the dense rule."""
    positions, documents = _packed([100, 300, 112])
    seq, cp = positions.shape[1], 2
    for rank in range(cp):
        local = headtail_indices(seq, cp, rank)
        gathered = torch.cat([headtail_indices(seq, cp, r) for r in range(cp)])
        qp, qd, kp, kd = positions[:, local], documents[:, local], positions[:, gathered], documents[:, gathered]
        block_mask = document_block_mask(qp, kp, qd, kd)
        tokens = create_mask(block_mask.mask_mod, B, 1, local.numel(), seq, device="cpu")
        assert torch.equal(tokens, document_causal_mask(qp, kp, qd, kd))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("documents", [False, True])
def test_flex_forward_on_cpu_equals_sdpa(documents: bool) -> None:
    """FlexAttention forward (eager; CPU has no flex backward) with grouped heads vs the dense SDPA path."""
    positions, document_ids = _packed([90, 150, 16])
    if not documents:
        positions = torch.arange(256).expand(B, -1)
    ids = document_ids if documents else None
    q, k, v = _qkv(positions.shape[1], grad=False)
    block_mask = document_block_mask(positions, positions, ids, ids)
    dense = document_causal_mask(positions, positions, document_ids, document_ids) if documents else None
    torch.testing.assert_close(flex(q, k, v, block_mask), sdpa(q, k, v, dense), rtol=1e-5, atol=1e-5)


GEMMA_SCORES = Scores(scale=0.3, softcap=2.0)  # (a cap that bites on these random scores)


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("documents", [False, True])
def test_soft_capped_and_windowed_dense_attention_equals_the_reference(documents: bool, window: int | None) -> None:
    """Gemma 2's attention on the dense path: another scale, soft-capped logits (an eager softmax: SDPA cannot
    cap), optionally a sliding window; values and gradients against the float64 reference."""
    positions, document_ids = _packed([7, 20, 5])
    if not documents:
        positions, document_ids = torch.arange(32).expand(B, -1), torch.zeros_like(document_ids)
    mask = document_causal_mask(positions, positions, document_ids, document_ids, window)
    q, k, v = _qkv(positions.shape[1])
    plain_causal = not documents and window is None  # (no mask: the kernel's own causal rule)
    got = _values_and_grads(sdpa(q, k, v, None if plain_causal else mask, GEMMA_SCORES), q, k, v)
    want = _values_and_grads(_reference(q, k, v, mask, GEMMA_SCORES), q, k, v)
    _assert_close(got, want)
    assert not torch.allclose(got[0].double(), _reference(q, k, v, mask, Scores(scale=0.3)))  # the cap mattered


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [None, 100])
def test_flex_soft_capping_and_window_forward_on_cpu_equal_the_dense_path(window: int | None) -> None:
    """The CUDA path's pieces, forward on CPU: the soft-capping score_mod and the windowed block mask."""
    positions, document_ids = _packed([90, 150, 16])
    q, k, v = _qkv(positions.shape[1], grad=False)
    block_mask = document_block_mask(positions, positions, document_ids, document_ids, window)
    dense = document_causal_mask(positions, positions, document_ids, document_ids, window)
    tokens = create_mask(block_mask.mask_mod, B, 1, positions.shape[1], positions.shape[1], device="cpu")
    assert torch.equal(tokens, dense)
    got, want = flex(q, k, v, block_mask, GEMMA_SCORES), sdpa(q, k, v, dense, GEMMA_SCORES)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cp, documents", [(2, False), (2, True), (3, True)])
def test_context_parallel_chunks_equal_full_attention(cp: int, documents: bool) -> None:
    """Each rank's per-chunk attention (keys limited to the chunk's end) over K/V in gather order gives its
    rows of full attention, values and gradients; and visits (2cp + 1) / 4cp of the dense mask's keys."""
    positions, document_ids = _packed([17, 50, 5] if cp == 2 else [30, 6, 36])
    seq = positions.shape[1]
    if not documents:
        positions, document_ids = torch.arange(seq).expand(B, -1), torch.zeros_like(document_ids)
    ids = document_ids if documents else None
    q, k, v = _qkv(seq)
    full = _reference(q, k, v, document_causal_mask(positions, positions, document_ids, document_ids))
    gathered = torch.cat([headtail_indices(seq, cp, r) for r in range(cp)])
    cotangent = torch.randn(full.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    want = torch.autograd.grad(full, (q, k, v), cotangent)
    got_grads = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(cp):
        local = headtail_indices(seq, cp, rank)
        state = chunk_masks(
            positions[:, local],
            positions[:, gathered],
            None if ids is None else ids[:, local],
            None if ids is None else ids[:, gathered],
            cp_size=cp,
            cp_rank=rank,
            kernel="sdpa",
        )
        assert state.masks is not None
        assert sum(m.shape[-1] for m in state.masks) == (2 * cp + 1) * seq // (2 * cp)
        out = state.attend(q[:, local], k[:, gathered], v[:, gathered])
        torch.testing.assert_close(out.double(), full[:, local], rtol=1e-5, atol=1e-5)
        grads = torch.autograd.grad(out, (q, k, v), cotangent[:, local].float())
        got_grads = [a + g for a, g in zip(got_grads, grads)]
    _assert_close(got_grads, list(want))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_context_parallel_flex_forward_equals_the_dense_chunks() -> None:
    """The CUDA form of context-parallel attention (one block mask over the keys in gather order), run
    forward on CPU, gives each rank the rows of the dense per-chunk path (1e-5)."""
    positions, documents = _packed([100, 300, 112])
    seq, cp = positions.shape[1], 2
    q, k, v = _qkv(seq, grad=False)
    gathered = torch.cat([headtail_indices(seq, cp, r) for r in range(cp)])
    for rank in range(cp):
        local = headtail_indices(seq, cp, rank)
        masks = {
            kernel: chunk_masks(
                positions[:, local],
                positions[:, gathered],
                documents[:, local],
                documents[:, gathered],
                cp_size=cp,
                cp_rank=rank,
                kernel=kernel,
            )
            for kernel in ("sdpa", "flex")
        }
        got, want = (masks[n].attend(q[:, local], k[:, gathered], v[:, gathered]) for n in ("flex", "sdpa"))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_packed_model_forward_with_flex_equals_sdpa_on_cpu() -> None:
    """The decoder's backend switch end to end: packed logits with the block mask equal the dense mask's."""
    from titanium.models import build_model_args, get_model_spec

    spec = get_model_spec("qwen3")
    model = spec.model_cls(build_model_args(spec, "debugmodel", vocab_size=300, max_seq_len=256))
    model.init_weights()
    positions, documents = _packed([150, 40, 66])
    tokens = torch.randint(0, 300, positions.shape, generator=torch.Generator().manual_seed(3))
    logits = {}
    for backend in ("sdpa", "flex"):
        model.attention_backend = backend
        with torch.no_grad():
            logits[backend] = model(tokens, positions=positions, document_ids=documents)
    torch.testing.assert_close(logits["flex"], logits["sdpa"], rtol=1e-5, atol=1e-5)


def test_auto_backend_picks_flex_only_on_cuda() -> None:
    assert masked_kernel("auto", torch.device("cpu")) == "sdpa"
    assert masked_kernel("auto", torch.device("cuda")) == "flex"
    assert masked_kernel("sdpa", torch.device("cuda")) == "sdpa"


CUDA = pytest.mark.cuda  # FlexAttention backward needs CUDA


@CUDA
def test_flex_forward_and_backward_on_cuda_equal_the_masked_reference() -> None:
    positions, document_ids = (t.cuda() for t in _packed([300, 500, 224]))
    q, k, v = (t.detach().cuda().requires_grad_() for t in _qkv(positions.shape[1]))
    block_mask = document_block_mask(positions, positions, document_ids, document_ids)
    mask = document_causal_mask(positions, positions, document_ids, document_ids)
    got = _values_and_grads(flex(q, k, v, block_mask), q, k, v)
    want = _values_and_grads(_reference(q, k, v, mask), q, k, v)
    for g, w in zip(got, want, strict=True):  # fp32 on tensor cores may use TF32-like reductions: 1e-3
        torch.testing.assert_close(g.double(), w.double(), rtol=1e-3, atol=1e-3)


@CUDA
def test_flex_soft_capped_windowed_forward_and_backward_on_cuda_equal_the_reference() -> None:
    """Gemma 2's attention on the CUDA kernel: the soft-capping score_mod and a windowed block mask, compiled."""
    positions, document_ids = (t.cuda() for t in _packed([300, 500, 224]))
    q, k, v = (t.detach().cuda().requires_grad_() for t in _qkv(positions.shape[1]))
    block_mask = document_block_mask(positions, positions, document_ids, document_ids, 200)
    mask = document_causal_mask(positions, positions, document_ids, document_ids, 200)
    got = _values_and_grads(flex(q, k, v, block_mask, GEMMA_SCORES), q, k, v)
    want = _values_and_grads(_reference(q, k, v, mask, GEMMA_SCORES), q, k, v)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w.double(), rtol=1e-3, atol=1e-3)


@CUDA
def test_packed_sft_forward_backward_with_flex_equals_sdpa_on_cuda() -> None:
    """A packed SFT microbatch (loss over response tokens, backward) through the model with flex and with
    dense SDPA: the same loss and gradients, float32. Two float32 kernels that sum in different orders differ by
    rounding of the size of the terms they add, not of the result: an element near 0 of a gradient whose other
    elements are ~100 (the loss is a sum over ~1,000 tokens) may differ by 1e-5 absolutely and 5% relatively (the
    H200 run: 2 of 76,800 embedding-gradient elements, 2.0e-5 apart). So the absolute tolerance is 1e-5 of the
    gradient's largest element: on CPU every float32 gradient of this model is within 8.5e-7 of its largest
    element from the float64 model's, so two float32 kernels are within about 1.7e-6 of it; a mask that lets a
    token see another document changes gradients by percents."""
    from titanium.models import build_model_args, get_model_spec
    from titanium.objectives.losses.cross_entropy import cross_entropy_sum

    spec = get_model_spec("qwen3")
    args = build_model_args(spec, "debugmodel", vocab_size=300, max_seq_len=512)
    positions, documents = (t.cuda() for t in _packed([200, 120, 192]))
    tokens = torch.randint(0, 300, positions.shape, generator=torch.Generator().manual_seed(3)).cuda()
    labels = torch.where((positions < 8) | (positions.roll(-1, 1) == 0), -100, tokens.roll(-1, 1))
    results = []
    for backend in ("sdpa", "flex"):
        model = spec.model_cls(args).cuda()
        model.init_weights(buffer_device="cuda")
        model.attention_backend = backend
        loss = cross_entropy_sum(model(tokens, positions=positions, document_ids=documents), labels)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (loss_sdpa, grads_sdpa), (loss_flex, grads_flex) = results
    torch.testing.assert_close(loss_flex, loss_sdpa, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_flex, grads_sdpa, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5 * b.abs().max().item())


def test_flex_is_refused_on_cpu_with_the_flag_to_change() -> None:
    from titanium.config.loader import ConfigError
    from titanium.model_builder import ModelBuilder

    with pytest.raises(ConfigError, match="--model.attention flex"):
        ModelBuilder(torch.device("cpu"), attention="flex")


def test_grouped_heads_go_to_sdpa_only_where_a_fused_kernel_takes_them() -> None:
    """On CUDA ``enable_gqa`` runs fused only in flash (half precision, no mask); elsewhere K/V are repeated."""
    from titanium.models.common.attention_kernels import _sdpa_reads_grouped_heads

    def q(device: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(1, 4, 8, 64, device=device, dtype=dtype)

    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    assert _sdpa_reads_grouped_heads(q("cpu", torch.float32), mask)
    assert _sdpa_reads_grouped_heads(q("meta", torch.bfloat16), None)
    assert not _sdpa_reads_grouped_heads(q("meta", torch.bfloat16), mask)
    assert not _sdpa_reads_grouped_heads(q("meta", torch.float32), None)
