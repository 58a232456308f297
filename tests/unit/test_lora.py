"""LoRA / QLoRA / DoRA on the meta-built decoder: init == base, freezing, merging, NF4 training, checkpoints.
(DoRA's and rsLoRA's numbers against PEFT: tests/parity/test_peft_export.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from titanium.checkpoint.hf import export_hf, load_hf_weights, save_hf_weights
from titanium.checkpoint.states import ModelState
from titanium.config.sections import LoRASection, OptimizerSection
from titanium.errors import UserError
from titanium.models import get_model_spec
from titanium.models.llama3 import LLAMA3_FLAVORS, Transformer
from titanium.models.llama3.hf import LLAMA3_HF_ADAPTER
from titanium.optim.optimizer import build_optimizer
from titanium.peft import (
    LoRALinear,
    apply_lora,
    freeze_base,
    init_lora,
    is_lora_param,
    lora_state_dict,
    merge_lora,
    quantize_lora_base_nf4,
)
from titanium.peft.nf4 import dequantize, is_nf4, to_nf4

ARGS = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], n_layers=2, vocab_size=256, max_seq_len=64, rope_scaling=None)
ALL = ["attention", "mlp", "output"]


def _lora(**kw) -> LoRASection:
    return LoRASection(**{"rank": 4, "alpha": 8.0, "target_modules": ALL, **kw})


def _build(cfg: LoRASection | None, seed: int = 0, args=ARGS) -> Transformer:
    """Meta model -> (apply_lora) -> to_empty -> init_weights -> (init_lora), as the trainer does."""
    with torch.device("meta"):
        model = Transformer(args)
    if cfg is not None:
        apply_lora(model, cfg)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device="cpu")
    if cfg is not None:
        init_lora(model, seed=seed)
    return model


def _randomize_b(model: nn.Module, seed: int = 3) -> None:
    """A trained-looking adapter: random B, DoRA magnitudes scaled by random factors in [0.8, 1.2]."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("lora_b.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            elif name.endswith("lora_magnitude"):
                p.mul_(0.8 + 0.4 * torch.rand(p.shape, generator=gen))


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_lora_at_init_is_the_base_model_bitwise(dora: bool) -> None:
    base, lora = _build(None), _build(_lora(use_dora=dora))
    adapted = [name for name, m in lora.named_modules() if isinstance(m, LoRALinear)]
    assert len(adapted) == 2 * 7 + 1
    # The base weights keep their names; the adapters are extra keys.
    base_state, lora_state = base.state_dict(), lora.state_dict()
    assert set(lora_state) == set(base_state) | {k for k in lora_state if is_lora_param(k)}
    assert "layers.0.attention.wq.lora_a.weight" in lora_state
    assert ("layers.1.feed_forward.w2.lora_magnitude" in lora_state) == dora
    if dora:  # DoRA's magnitudes start at the row norms of the base weights
        w2 = base_state["layers.1.feed_forward.w2.weight"]
        assert torch.equal(lora_state["layers.1.feed_forward.w2.lora_magnitude"], w2.norm(dim=1))
    for key, value in base_state.items():
        assert torch.equal(lora_state[key], value), key
    assert lora.layers["0"].attention.wq.lora_a.weight.abs().sum() > 0
    assert all(torch.count_nonzero(v) == 0 for k, v in lora_state.items() if "lora_b" in k)
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(lora(tokens), base(tokens))


def test_init_lora_depends_only_on_seed_and_layer_name() -> None:
    one, again = _build(_lora(), seed=5), _build(_lora(), seed=5)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in one.state_dict().items())
    # A model holding fewer layers (a pipeline stage) draws the same values for the ones it has.
    deeper = _build(_lora(), seed=5, args=dataclasses.replace(ARGS, n_layers=3))
    key = "layers.1.feed_forward.w2.lora_a.weight"
    assert torch.equal(deeper.state_dict()[key], one.state_dict()[key])
    a = one.layers["0"].attention.wq.lora_a.weight
    bound = 1 / a.shape[1] ** 0.5  # kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound
    assert not torch.equal(a, one.layers["0"].attention.wk.lora_a.weight)
    # Without a seed: one draw from torch's global generator.
    states = []
    for _ in range(2):
        torch.manual_seed(11)
        init_lora(one)
        states.append(one.layers["1"].attention.wv.lora_a.weight.clone())
    assert torch.equal(*states) and not torch.equal(states[0], again.layers["1"].attention.wv.lora_a.weight)


def test_freeze_leaves_only_adapters_trainable_and_optimizer_gets_them() -> None:
    model = _build(_lora(target_modules=["wq", "wv"]))
    n = freeze_base(model)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    names = [f"layers.{i}.attention.{w}.{ab}.weight" for i in "01" for w in ("wq", "wv") for ab in ("lora_a", "lora_b")]
    assert trainable == set(names)
    assert n == sum(p.numel() for p in lora_state_dict(model).values())
    F.cross_entropy(model(_tokens()).flatten(0, 1), _tokens(2).flatten()).backward()
    assert all((p.grad is not None) == p.requires_grad for p in model.parameters())
    optimizer = build_optimizer(model, OptimizerSection())
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in model.parameters() if p.requires_grad}


@pytest.mark.parametrize("kw", [{}, {"use_dora": True, "use_rslora": True}], ids=["lora", "dora-rslora"])
def test_merge_matches_the_adapted_forward(kw: dict) -> None:
    model = _build(_lora(dropout=0.1, **kw))
    _randomize_b(model)
    merged_state = merge_lora(model)
    assert not any(is_lora_param(k) for k in merged_state)
    plain = _build(None)
    plain.load_state_dict(merged_state, strict=True)
    tokens = _tokens()
    model.eval()
    with torch.no_grad():
        ours = model(tokens)
        assert (ours - plain(tokens)).abs().max() <= 1e-5
        assert (ours - _build(None)(tokens)).abs().max() > 1e-3  # the adapters do change the output


def test_hugging_face_names_find_our_layers() -> None:
    """``q_proj`` and ``down_proj`` name ``wq`` and ``w2``, matched as PEFT matches them through the family's
    Hugging Face names (a model of the transformers backend keeps HF's names)."""
    with torch.device("meta"):
        model = Transformer(ARGS)
    adapted = apply_lora(model, _lora(target_modules=["q_proj", "down_proj"]), get_model_spec("llama3").hf_adapter)
    assert {name.rsplit(".", 1)[-1] for name in adapted} == {"wq", "w2"}


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"target_modules": ["q_proj"]}, "Hugging Face names need a family with a Hugging Face adapter"),
        ({"target_modules": ["wz"]}, "use titanium's names (wq, wk, wv, wo, w1, w2, w3, output"),
        ({"target_modules": []}, "target_modules is empty"),
        ({"rank": -1}, "--lora.rank must be >= 0"),
        ({"alpha": 0.0}, "--lora.alpha must be > 0"),
        ({"dropout": 1.0}, "--lora.dropout must be in [0, 1)"),
        ({"rank": 0, "use_dora": True}, "--lora.use_dora needs LoRA: set --lora.rank"),
        ({"rank": 0, "use_rslora": True}, "--lora.use_rslora needs LoRA: set --lora.rank"),
    ],
)
def test_bad_config_is_a_user_error(kw: dict, message: str) -> None:
    with torch.device("meta"):
        model = Transformer(ARGS)
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        apply_lora(model, _lora(**kw))


def test_rank_zero_is_a_no_op_and_unadaptable_layers_are_refused() -> None:
    with torch.device("meta"):
        model = Transformer(ARGS)
        tied = Transformer(dataclasses.replace(ARGS, tie_word_embeddings=True))
    assert apply_lora(model, LoRASection(rank=0)) == []
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    with pytest.raises(UserError, match="remove 'output' from --lora.target_modules"):
        apply_lora(tied, _lora())
    assert len(apply_lora(tied, _lora(target_modules=["attention"]))) == 8
    with torch.device("meta"):
        converted = Transformer(ARGS)
    converted.layers["1"].feed_forward.w2.__class__ = type("Float8Linear", (nn.Linear,), {})
    with pytest.raises(UserError, match="'layers.1.feed_forward.w2' is a Float8Linear"):
        apply_lora(converted, _lora())
    assert not any(isinstance(m, LoRALinear) for m in converted.modules())  # a failed call changes nothing


def test_expert_adapters_are_refused_where_they_cannot_work() -> None:
    """``experts`` on a dense model; dropout, DoRA or an NF4 base with the experts' weight update."""
    from titanium.models import build_model_args, get_model_spec

    spec = get_model_spec("qwen3_moe")
    with torch.device("meta"):
        dense = Transformer(ARGS)
        moe = spec.model_cls(build_model_args(spec, "debugmodel_moe"))
    with pytest.raises(UserError, match="the model has no MoE experts named experts"):
        apply_lora(dense, _lora(target_modules=["experts"]))
    for bad in ({"dropout": 0.1}, {"use_dora": True}, {"quantize_base": "nf4"}):
        with pytest.raises(UserError, match="set --lora.dropout 0, --lora.use_dora false and --lora.quantize_base"):
            apply_lora(moe, _lora(target_modules=["wq", "experts"], **bad))
    assert not any(isinstance(m, LoRALinear) for m in moe.modules())  # a failed call changes nothing
    assert len(apply_lora(moe, _lora(target_modules=["experts"]))) == 4


@pytest.mark.parametrize("dora", [False, True], ids=["qlora", "qdora"])
def test_qlora_trains_on_cpu(dora: bool) -> None:
    model = _build(_lora(target_modules=["attention", "mlp"], use_dora=dora))
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    assert quantize_lora_base_nf4(model) == 14
    init_lora(model, seed=0)  # (as the converter does: DoRA's magnitudes are the NF4 weights' norms)
    wq = model.layers["0"].attention.wq
    assert is_nf4(wq.weight) and not wq.weight.requires_grad
    assert (wq.weight.get_original_weight() - reference["layers.0.attention.wq.weight"]).abs().max() < 0.05
    freeze_base(model)
    optimizer = build_optimizer(model, OptimizerSection(lr=1e-2, weight_decay=0.0))
    tokens = _tokens()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        assert wq.lora_a.weight.grad is not None and wq.lora_b.weight.grad.abs().sum() > 0
        assert (wq.lora_magnitude is not None and wq.lora_magnitude.grad.abs().sum() > 0) == dora
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    assert is_nf4(wq.weight) and wq.weight.grad is None
    state = model.state_dict()  # norms and embeddings were frozen too
    assert torch.equal(state["tok_embeddings.weight"], reference["tok_embeddings.weight"])
    # The merged model (NF4 dequantized + B @ A) computes what the QLoRA model computes.
    plain = _build(None)
    plain.load_state_dict(merge_lora(model))
    with torch.no_grad():
        assert (plain(inputs) - model(inputs)).abs().max() <= 1e-5


def test_model_state_saves_and_loads_only_the_adapters() -> None:
    model = _build(_lora())
    _randomize_b(model)
    freeze_base(model)
    state = ModelState(model, part="trainable").state_dict()
    assert set(state) == set(lora_state_dict(model)) and state
    restored = _build(_lora(), seed=9)
    freeze_base(restored)
    ModelState(restored, part="trainable").load_state_dict({k: v.clone() for k, v in state.items()})
    for key, value in lora_state_dict(restored).items():
        assert torch.equal(value, state[key]), key
    assert set(ModelState(model).state_dict()) == set(model.state_dict())


def test_hf_load_keeps_adapters_and_hf_export_merges(tmp_path) -> None:
    base = _build(None, seed=4)
    save_hf_weights(base.state_dict(), tmp_path / "base", LLAMA3_HF_ADAPTER, ARGS)
    model = _build(_lora())
    _randomize_b(model)
    adapters = {k: v.clone() for k, v in lora_state_dict(model).items()}
    load_hf_weights(model, tmp_path / "base", LLAMA3_HF_ADAPTER, ARGS)
    key = "layers.1.feed_forward.w3.weight"
    assert torch.equal(model.state_dict()[key], base.state_dict()[key])
    assert all(torch.equal(v, adapters[k]) for k, v in lora_state_dict(model).items())
    export_hf(model, tmp_path / "merged", LLAMA3_HF_ADAPTER, ARGS)
    plain = _build(None)
    load_hf_weights(plain, tmp_path / "merged", LLAMA3_HF_ADAPTER, ARGS)
    tokens = _tokens()
    with torch.no_grad():
        assert (plain(tokens) - model(tokens)).abs().max() <= 1e-5


def test_nf4_splits_evenly_into_fsdp_shards() -> None:
    """FSDP2 chunks an NF4 weight by rows; each chunk must dequantize to the same rows of the whole."""
    # 256 NF4 blocks: one double-quantization group of 256 at torchao's default
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    whole = dequantize(to_nf4(weight))
    # NF4 levels are at most 0.28 of a block's absmax apart: each value is within 0.16 x its block's absmax
    # (a little over half the widest gap, for the 8-bit double-quantized scale).
    error, scale = (whole - weight).view(-1, 64).abs().amax(1), weight.view(-1, 64).abs().amax(1)
    assert (error <= 0.16 * scale).all(), (error / scale).max()
    sharded = to_nf4(weight, shard_degree=4)
    chunks = torch.chunk(sharded, 4)
    assert all(is_nf4(c) and c.shape == (16, 256) for c in chunks)
    rows = torch.cat([dequantize(c) for c in chunks])
    assert torch.equal(rows, dequantize(sharded))
    with pytest.raises(UserError, match="split evenly over 3"):
        to_nf4(weight, "layers.0.attention.wk.weight", shard_degree=3)
    with pytest.raises(UserError, match="not|cannot"):
        to_nf4(torch.randn(3, 7))


def test_rslora_scale_and_dora_dropout_follow_peft() -> None:
    """rsLoRA scales by alpha / sqrt(rank). DoRA with dropout, training: PEFT's formula, both added terms on the
    dropped input, ``W x + (m/n - 1) W drop(x) + (m/n) s B A drop(x)`` with ``n = ||W + s B A||`` per row."""
    model = _build(_lora(rank=16, alpha=8.0, dropout=0.5, use_dora=True, use_rslora=True))
    _randomize_b(model)
    w2 = model.layers["0"].feed_forward.w2
    assert w2.lora_scale == 8.0 / 4
    x = torch.randn(3, w2.in_features)
    torch.manual_seed(0)
    got = w2(x)
    torch.manual_seed(0)
    dropped = w2.lora_dropout(x)
    with torch.no_grad():
        norm = (w2.weight + w2.lora_scale * w2.lora_b.weight @ w2.lora_a.weight).norm(dim=1)
    ratio = w2.lora_magnitude / norm
    expected = F.linear(x, w2.weight) + (ratio - 1) * F.linear(dropped, w2.weight)
    expected = expected + ratio * w2.lora_scale * w2.lora_b(w2.lora_a(dropped))
    torch.testing.assert_close(got, expected)
    assert (got - w2.eval()(x)).abs().max() > 1e-3  # dropout was on
