"""Qwen3-MoE matches ``transformers``' ``Qwen3MoeForCausalLM``: logits, gradients with the auxiliary loss, the aux
loss itself, and a byte-identical round trip of the per-expert safetensors layout.

Three random tiny configs, two of them odd: 6 experts top-3 with an expert width of 36 (not a multiple of 8),
a dense layer in ``mlp_only_layers`` and ``norm_topk_prob`` false; and every other layer sparse
(``decoder_sparse_step`` 2) with 5 experts top-1 and tied embeddings. Tolerances (fp32): logits 1e-5, gradients
1e-6 (absolute; gradients here are up to ~1), aux loss 1e-6 relative.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.parity.harness import (
    ParityCase,
    assert_round_trip,
    load_titanium,
    make_hf_checkpoint,
    max_logit_diff,
    random_tokens,
)
from titanium.models import get_model_spec
from titanium.models.common.moe import moe_layers, switch_aux_loss

transformers = pytest.importorskip("transformers")

VOCAB = 256
AUX_COEF = 0.02


def qwen3_moe(id: str, **moe) -> ParityCase:
    def config():
        fields = dict(
            hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=VOCAB, max_position_embeddings=128, rms_norm_eps=1e-6,
            router_aux_loss_coef=AUX_COEF, tie_word_embeddings=False,
        )  # fmt: skip
        return transformers.Qwen3MoeConfig(**{**fields, **moe})

    return ParityCase(id, "qwen3_moe", lambda: transformers.Qwen3MoeForCausalLM, config)


CASES = [  # fmt: skip
    qwen3_moe("8e_top2", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    qwen3_moe(
        "6e_top3_odd",
        num_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=36,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    ),
    qwen3_moe(
        "5e_top1_sparse_step2",
        num_experts=5,
        num_experts_per_tok=1,
        moe_intermediate_size=20,
        norm_topk_prob=True,
        decoder_sparse_step=2,
        num_hidden_layers=4,
        tie_word_embeddings=True,
    ),
]


def hf_grads_on_disk(hf_model) -> dict[str, torch.Tensor]:
    """The HF model's gradients under its checkpoint names: in memory transformers stacks the experts
    (``gate_up_proj`` ``[E, 2F, D]``, ``down_proj`` ``[E, D, F]``), on disk each expert has its own tensors."""
    out = {}
    for name, p in hf_model.named_parameters():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, hidden = name.removesuffix("gate_up_proj"), p.shape[1] // 2
            for e in range(p.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = p.grad[e, :hidden]
                out[f"{prefix}{e}.up_proj.weight"] = p.grad[e, hidden:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            out.update({f"{prefix}{e}.down_proj.weight": p.grad[e] for e in range(p.shape[0])})
        else:
            out[name] = p.grad
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_qwen3_moe_matches_transformers(tmp_path, case):
    source = tmp_path / "hf"
    hf_model = make_hf_checkpoint(case, source)
    model, args, ckpt = load_titanium(source, case)
    assert sorted(moe_layers(model)) == [
        i for i, layer in enumerate(hf_model.model.layers) if hasattr(layer.mlp, "gate")
    ]
    assert args.router_aux_loss_coef == AUX_COEF and args.norm_topk_prob == case.hf_config().norm_topk_prob

    tokens = random_tokens(VOCAB, case.seq_len)
    assert max_logit_diff(hf_model, model, tokens) <= 1e-5

    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    hf_out = hf_model.train()(input_ids=inputs, output_router_logits=True)
    (F.cross_entropy(hf_out.logits.flatten(0, 1), labels.flatten()) + AUX_COEF * hf_out.aux_loss).backward()
    model.train()
    for layer in moe_layers(model).values():
        layer.keep_routing_stats = True
    loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
    stats = [layer.routing_stats for layer in moe_layers(model).values()]
    aux = switch_aux_loss(sum(s.counts for s in stats), sum(s.score_sums for s in stats), sum(s.tokens for s in stats))
    assert aux.item() == pytest.approx(hf_out.aux_loss.item(), rel=1e-6)
    (loss + AUX_COEF * aux).backward()
    adapter = get_model_spec(case.model).hf_adapter
    ours = adapter.to_hf({name: p.grad for name, p in model.named_parameters()}, args)
    expected = hf_grads_on_disk(hf_model)
    assert set(ours) == set(expected), set(ours) ^ set(expected)
    worst = max((ours[k] - v).abs().max().item() for k, v in expected.items())
    assert worst <= 1e-6

    assert_round_trip(case, source, tmp_path / "out", model, args, ckpt)
