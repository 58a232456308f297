"""The MoE feed-forward: grouped GEMMs, router, layer output against a per-token reference, counting, and the
Qwen3-MoE flavors (published parameter counts, which layers are MoE)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from titanium.config.sections import MoESection
from titanium.models import get_model_spec
from titanium.models.common.moe import MoE, MoEArgs, expert_swiglu, grouped_gemm_kind, moe_layers, switch_aux_loss
from titanium.models.flops import count_params_on_meta
from titanium.models.hf_adapter import HFExportError
from titanium.models.qwen3_moe import QWEN3_MOE_FLAVORS, Qwen3MoeArgs, Qwen3MoeTransformer
from titanium.moe_balance import LoadBalancer


def _experts(e: int, d: int, f: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(e, *s, generator=gen) / 4).to(dtype).requires_grad_() for s in ((f, d), (d, f), (f, d))]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemms_agree_with_the_loop(dtype, device):
    """All kinds give the loop's output and gradients (uneven and empty groups included), on CPU and on a GPU, where
    bfloat16 takes ``torch._grouped_mm`` (the GPU's kind; float32 there is padded ``bmm``)."""
    counts = torch.tensor([5, 0, 3, 9, 0, 1], device=device)
    weights = [w.detach().to(device).requires_grad_() for w in _experts(6, 16, 24, dtype)]  # (rows: 16-byte multiples)
    x = torch.randn(int(counts.sum()), 16, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    x.requires_grad_()
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    gpu_kind = "grouped_mm" if dtype == torch.bfloat16 else "padded_bmm"
    if device == "cuda":
        assert grouped_gemm_kind(x, weights[0]) == gpu_kind
    kinds = ("padded_bmm", "grouped_mm") if device == "cpu" else (gpu_kind,)
    results = {}
    for kind in ("loop", *kinds):
        out = expert_swiglu(x, counts, *weights, kind=kind)
        results[kind] = [out, *torch.autograd.grad(out, [x, *weights], grad)]
    for kind in kinds:
        for got, want in zip(results[kind], results["loop"]):
            torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)


def _reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert: what the layer must compute."""
    a = moe.args
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    out = []
    for token in x.reshape(-1, x.shape[-1]):
        logits = moe.router.gate(token).float()
        scores = logits.softmax(-1) if a.score_func == "softmax" else logits.sigmoid()
        chosen = (scores + moe.expert_bias).topk(a.top_k).indices
        gates = scores[chosen]
        if a.norm_topk_prob:
            gates = gates / gates.sum()
        y = sum(g * a.route_scale * (w2[e] @ (F.silu(w1[e] @ token) * (w3[e] @ token))) for g, e in zip(gates, chosen))
        if moe.shared_experts is not None:
            y = y + moe.shared_experts(token)
        out.append(y)
    return torch.stack(out).view_as(x)


@pytest.mark.parametrize(
    "args",
    [
        MoEArgs(num_experts=6, top_k=3, expert_dim=20, norm_topk_prob=False),
        MoEArgs(num_experts=8, top_k=2, expert_dim=12, score_func="sigmoid", route_scale=2.5, shared_expert_dim=24),
    ],
    ids=["softmax", "sigmoid_shared_scaled"],
)
def test_layer_matches_per_token_reference(args):
    torch.manual_seed(0)
    moe = MoE(16, args)
    moe.init_weights(0.2, 0.2)
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(moe(x), _reference_moe(moe, x), rtol=0, atol=1e-6)


def test_bias_changes_the_choice_not_the_gates():
    """And every forward chooses with it, with no load balancer attached (a frozen copy of a trained model, a
    rollout engine's): a trained bias is part of the model."""
    torch.manual_seed(0)
    moe = MoE(16, MoEArgs(num_experts=4, top_k=1, expert_dim=8))
    moe.init_weights(0.2, 0.2)
    x = torch.randn(10, 16)
    moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 10.0, 0.0]))  # everyone picks expert 2 ...
    weights, chosen, scores = moe.router(x, moe.expert_bias)
    assert (chosen == 2).all()
    torch.testing.assert_close(weights, torch.ones_like(weights))  # top-1, normalized
    moe.args = moe.router.args = dataclasses.replace(moe.args, norm_topk_prob=False)
    weights, _, scores = moe.router(x, moe.expert_bias)
    torch.testing.assert_close(weights[:, 0], scores[:, 2])  # ... gated by its unbiased score
    torch.testing.assert_close(moe(x), _reference_moe(moe, x), rtol=0, atol=1e-6)


def test_counts_once_per_training_forward():
    """Training forwards add to tokens_per_expert; no-grad forwards and activation-checkpoint recomputes do not."""
    torch.manual_seed(0)
    moe = MoE(16, MoEArgs(num_experts=4, top_k=2, expert_dim=8))
    moe.init_weights(0.2, 0.2)
    x = torch.randn(6, 16, requires_grad=True)
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert moe.tokens_per_expert.sum().item() == 12
    with torch.no_grad():
        moe(x)
    moe.eval()
    moe(x)
    assert moe.tokens_per_expert.sum().item() == 12
    moe.train()
    moe.keep_routing_stats = True
    moe(x)
    stats = moe.routing_stats
    assert stats is not None and stats.tokens == 6 and stats.counts.sum().item() == 12
    assert stats.score_sums.requires_grad and stats.score_sums.sum().item() == pytest.approx(6.0)


def test_switch_aux_loss_is_one_when_balanced():
    """Perfectly even counts and scores give E * sum(1/E * 1/E) * k = top_k (transformers' normalization)."""
    counts = torch.full((4,), 2 * 6 / 4)  # 6 tokens, top-2
    assert switch_aux_loss(counts, torch.full((4,), 6 / 4), 6).item() == pytest.approx(2.0)


# Exact totals and active parameters per token of the published checkpoints (config.json arithmetic).
PUBLISHED = {"30B-A3B": (30_532_122_624, 3_353_032_704), "235B-A22B": (235_093_634_560, 22_190_763_520)}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_parameter_counts_match_published(flavor):
    a = QWEN3_MOE_FLAVORS[flavor]
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    attention = a.dim * q + 2 * a.dim * kv + q * a.dim + 2 * a.head_dim
    moe = a.num_experts * 3 * a.dim * a.moe_dim + a.dim * a.num_experts
    closed_form = a.n_layers * (attention + moe + 2 * a.dim) + a.dim + 2 * a.vocab_size * a.dim
    total, active = PUBLISHED[flavor]
    assert count_params_on_meta(Qwen3MoeTransformer, a) == closed_form == total
    routed_inactive = a.n_layers * (a.num_experts - a.top_k) * 3 * a.dim * a.moe_dim
    assert count_params_on_meta(Qwen3MoeTransformer, a, active_only=True) == active == total - routed_inactive
    without_embedding = count_params_on_meta(Qwen3MoeTransformer, a, exclude_embedding=True, active_only=True)
    assert without_embedding == active - a.vocab_size * a.dim  # (what the FLOPs count)
    assert f"{total / 1e9:.1f}B" == {"30B-A3B": "30.5B", "235B-A22B": "235.1B"}[flavor]


def test_moe_layer_placement():
    """Hugging Face's rule: every decoder_sparse_step-th layer (1-based), except mlp_only_layers."""
    base = QWEN3_MOE_FLAVORS["debugmodel_moe"]
    args = dataclasses.replace(base, n_layers=6, decoder_sparse_step=2, mlp_only_layers=(3,))
    with torch.device("meta"):
        model = Qwen3MoeTransformer(args)
    assert sorted(moe_layers(model)) == [1, 5]
    assert model.layers["0"].moe is None and model.layers["0"].feed_forward is not None
    assert model.layers["1"].feed_forward is None
    with pytest.raises(ValueError, match="mlp_only_layers"):
        dataclasses.replace(base, mlp_only_layers=(4,))
    with pytest.raises(ValueError, match="top_k"):
        Qwen3MoeArgs(dim=8, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=8, ffn_dim=8, num_experts=2, top_k=3)
    assert get_model_spec("qwen3_moe").flavors is QWEN3_MOE_FLAVORS


def test_export_refuses_a_trained_routing_bias():
    """Qwen3-MoE's HF format has no slot for the bias: zero is skipped, anything else is refused by name."""
    args = QWEN3_MOE_FLAVORS["debugmodel_moe"]
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Qwen3MoeTransformer(args).state_dict().items()}
    adapter = get_model_spec("qwen3_moe").hf_adapter
    state = {k: torch.zeros(s) for k, s in shapes.items() if k.startswith("layers.0.moe.")}
    hf = adapter.to_hf(state, args)
    assert sorted(hf) == sorted(adapter.hf_shapes({k: shapes[k] for k in state}, args))
    assert len(hf) == 1 + 3 * args.num_experts and "model.layers.0.mlp.experts.7.up_proj.weight" in hf
    state["layers.0.moe.expert_bias"][3] = 0.01
    with pytest.raises(HFExportError, match=r"layers\.0\.moe\.expert_bias is not zero.*--moe.load_balance aux_loss"):
        adapter.to_hf(state, args)


def test_bias_update_moves_towards_the_mean_load():
    """After a step, each layer's bias rises for its underloaded experts and falls for the overloaded ones."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        moe = MoE(16, MoEArgs(num_experts=4, top_k=1, expert_dim=8))
        moe.init_weights(0.2, 0.2)
        cfg = MoESection(load_balance="bias", bias_update_rate=0.01)
        balancer = LoadBalancer(cfg, {0: moe}, aux_loss_coef=0.0, microbatches=1, loss_group=dist.group.WORLD)
        assert not moe.keep_routing_stats
        moe(torch.randn(40, 16))
        load = moe.tokens_per_expert.float()
        balancer.after_optimizer_step()
        step = 0.01 * torch.sign(load.mean() - load)
        torch.testing.assert_close(moe.expert_bias, step - step.mean())
        assert moe.tokens_per_expert.sum() == 0
        assert balancer.metrics()["moe/max_load/layer_0"] == pytest.approx((load.max() / load.mean()).item())
    finally:
        dist.destroy_process_group()
