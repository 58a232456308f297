"""LoRA targets spelled as PEFT spells them (``q_proj``, ``self_attn.o_proj``, ``all-linear``, regular expressions)
adapt exactly the layers PEFT adapts on the family's transformers model: the adapted layers' Hugging Face names are
the names of the modules ``peft.get_peft_model`` wraps."""

from __future__ import annotations

import pytest
import torch

from titanium.config.sections import LoRASection
from titanium.errors import UserError
from titanium.models import build_model_args, get_model_spec
from titanium.peft.lora import apply_lora, check_peft_targets, hf_module_name

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

HF_CLASSES = {"llama3": "LlamaForCausalLM", "phi3": "Phi3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
FLAVORS = {"llama3": "debugmodel", "phi3": "debugmodel", "qwen3_moe": "debugmodel_moe"}


def _ours(family: str, targets: list[str]) -> set[str]:
    spec = get_model_spec(family)
    args = build_model_args(spec, FLAVORS[family], n_layers=2)
    with torch.device("meta"):
        model = spec.model_cls(args)
    adapted = apply_lora(model, LoRASection(rank=2, target_modules=targets), spec.hf_adapter)
    return {hf_module_name(name, spec.hf_adapter) for name in adapted}


def _peft(family: str, targets: list[str] | str) -> set[str]:
    spec = get_model_spec(family)
    config = spec.hf_adapter.to_hf_config(build_model_args(spec, FLAVORS[family], n_layers=2))
    hf_cls = getattr(transformers, HF_CLASSES[family])
    with torch.device("meta"):
        model = hf_cls(hf_cls.config_class(**config))
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=targets))
    prefix = "base_model.model."
    return {name.removeprefix(prefix) for name, m in wrapped.named_modules() if hasattr(m, "lora_A") and name}


@pytest.mark.parametrize(
    ("family", "targets"),
    [
        ("llama3", ["q_proj", "v_proj"]),
        ("llama3", ["self_attn.o_proj", "down_proj", "lm_head"]),
        ("llama3", "all-linear"),
        ("llama3", r".*\.layers\.1\.(self_attn\.(q|k)_proj|mlp\.up_proj)"),
        ("phi3", ["qkv_proj", "gate_up_proj"]),
        ("phi3", "all-linear"),
        ("qwen3_moe", ["q_proj", "o_proj"]),
    ],
)
def test_peft_names_adapt_what_peft_adapts(family, targets):
    ours = _ours(family, [targets] if isinstance(targets, str) else targets)
    assert ours == _peft(family, targets) and ours


def test_all_linear_on_moe_leaves_router_and_experts_to_be_named():
    """PEFT 0.21's all-linear on a transformers MoE model also wraps each router and the stacked experts; titanium's
    adapts the blocks' linear layers only (the experts take titanium's ``experts``; routers are not adapted)."""
    ours = _ours("qwen3_moe", ["all-linear"])
    peft_wrapped = _peft("qwen3_moe", "all-linear")
    assert ours == {name for name in peft_wrapped if name.rsplit(".", 1)[-1].endswith("_proj")}
    assert {name.rsplit(".", 1)[-1] for name in peft_wrapped - ours} == {"gate", "experts", "base_layer"}


def test_titanium_names_still_work_and_mix():
    assert _ours("llama3", ["attention"]) == _peft("llama3", ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert _ours("llama3", ["wq", "down_proj"]) == _peft("llama3", ["q_proj", "down_proj"])


def test_names_the_family_lacks_are_refused_with_its_names():
    adapter = get_model_spec("phi3").hf_adapter
    with pytest.raises(UserError, match=r"'q_proj' matches no linear layer of phi3 \(its Hugging Face names: .*qkv"):
        check_peft_targets(["q_proj"], adapter, "phi3")
    with pytest.raises(UserError, match="'wqq' matches no linear layer"):
        _ours("llama3", ["wqq"])
    with pytest.raises(UserError, match="not a regular expression"):
        _ours("llama3", ["q_proj("])
