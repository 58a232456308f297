"""A LoRA adapter exported in PEFT layout, loaded by ``peft`` onto the ``transformers`` base, is the titanium
model; so is the merged Hugging Face export loaded by ``transformers`` alone. DoRA + rsLoRA adapters too, and
their gradients and merge are PEFT's.

Random base (every weight, norm scales included) and random non-zero ``lora_B`` (and DoRA magnitudes away
from their starting norms), so a missing or wrong RoPE permutation of q/k adapters, or a swapped name, shows
in the logits. Tolerance: max abs diff 1e-5 for logits. Every family; Phi-3's fused ``qkv_proj``/``gate_up_proj``
get one stacked adapter each (rank and alpha times the parts, in ``rank_pattern``/``alpha_pattern``), with all
or only some of the parts adapted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.parity.harness import ParityCase, make_hf_checkpoint, random_tokens
from tests.parity.test_parity import VOCAB, gemma2, llama, mistral, phi3, qwen2, qwen3
from titanium.checkpoint.hf import export_hf, load_hf_weights, read_hf_config
from titanium.config.sections import LoRASection
from titanium.models import get_model_spec
from titanium.peft import apply_lora, export_peft_adapter, init_lora, lora_state_dict, peft_state_dict
from titanium.peft.lora import lora_modules

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ATOL = 1e-5
LLAMA_NAMES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
CASES = [  # (case, our targets, PEFT target_modules, PEFT modules per layer)
    pytest.param(
        llama(n_kv_heads=2, tied=False), ["attention", "mlp", "output"], LLAMA_NAMES | {"lm_head"}, 7,
        id="llama3-gqa-untied",
    ),
    pytest.param(qwen3(tied=True), ["attention", "mlp"], LLAMA_NAMES, 7, id="qwen3-tied"),
    pytest.param(qwen2(tied=False, kv_heads=1), ["attention", "mlp"], LLAMA_NAMES, 7, id="qwen2-biases"),
    pytest.param(
        mistral(window=8, head_dim=24), ["attention"], {"q_proj", "k_proj", "v_proj", "o_proj"}, 4, id="mistral"
    ),
    # Phi-3's fused tensors: one stacked adapter per fused module, all of its parts or some of them.
    pytest.param(
        phi3(window=8, kv_heads=4), ["attention", "mlp"], {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}, 4,
        id="phi3-fused",
    ),
    pytest.param(phi3(window=None, kv_heads=2), ["wk", "w3"], {"qkv_proj", "gate_up_proj"}, 2, id="phi3-fused-parts"),
    pytest.param(
        gemma2(softcaps=(1.5, 2.0), window=8, layer_types=None, tied=True), ["attention", "mlp"], LLAMA_NAMES, 7,
        id="gemma2",
    ),
]  # fmt: skip


def _lora_model_from_hf(folder: Path, case: ParityCase, cfg: LoRASection):
    """Trainer order: meta model -> apply_lora -> to_empty + init -> HF load -> init_lora; then random B and
    DoRA magnitudes scaled by random factors in [0.8, 1.2]."""
    spec = get_model_spec(case.model)
    args = spec.hf_adapter.from_hf_config(read_hf_config(folder), max_seq_len=64)
    with torch.device("meta"):
        model = spec.model_cls(args)
    apply_lora(model, cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device="cpu")
    load_hf_weights(model, folder, spec.hf_adapter, args)
    init_lora(model, seed=0)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif name.endswith("lora_magnitude"):
                p.mul_(0.8 + 0.4 * torch.rand(p.shape, generator=gen))
    return model.eval(), args, spec.hf_adapter


@pytest.mark.parametrize(("case", "targets", "peft_targets", "per_layer"), CASES)
def test_peft_adapter_and_merged_export_match_titanium(
    case: ParityCase, targets: list[str], peft_targets: set[str], per_layer: int, tmp_path: Path
) -> None:
    source = tmp_path / "hf"
    hf_model = make_hf_checkpoint(case, source)
    cfg = LoRASection(rank=4, alpha=8.0, target_modules=targets)
    model, args, adapter = _lora_model_from_hf(source, case, cfg)
    tokens = random_tokens(VOCAB, case.seq_len)
    with torch.no_grad():
        ours = model(tokens)
        assert (ours - hf_model(input_ids=tokens).logits).abs().max() > 1e-2  # the adapters matter

    out = export_peft_adapter(model, adapter, args, cfg, tmp_path / "adapter", base_model_name_or_path=str(source))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert set(config["target_modules"]) == peft_targets
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert {key.split(".")[-3] for key in keys} == peft_targets  # (..., q_proj, lora_B, weight)
    assert len(keys) == 2 * per_layer * 2 + (2 if "output" in targets else 0)
    assert not (tmp_path / ".adapter.partial").exists()

    if case.model == "phi3" and targets == ["attention", "mlp"]:  # 3 (q, k, v) and 2 (gate, up) adapters stacked
        assert config["rank_pattern"] == {"qkv_proj": 12, "gate_up_proj": 8}
        assert config["alpha_pattern"] == {"qkv_proj": 24.0, "gate_up_proj": 16.0}
    with_adapter = peft.PeftModel.from_pretrained(hf_model, out).eval()
    with torch.no_grad():
        diff = (with_adapter(input_ids=tokens).logits - ours).abs().max().item()
    assert diff <= ATOL, f"{case.id}: PEFT adapter logits differ by {diff:.2e}"

    merged = export_hf(model, tmp_path / "merged", adapter, args, source_folder=source)
    reloaded = case.hf_model().from_pretrained(merged, attn_implementation="eager").eval()
    with torch.no_grad():
        diff = (reloaded(input_ids=tokens).logits - ours).abs().max().item()
    assert diff <= ATOL, f"{case.id}: merged export logits differ by {diff:.2e}"


def _peft_grads(peft_model) -> dict[str, torch.Tensor]:
    """PEFT's adapter gradients under the names of its saved adapter file."""
    grads = {}
    for name, p in peft_model.named_parameters():
        if p.requires_grad:
            key = name.replace(".default", "")
            grads[key.removesuffix(".weight") if "lora_magnitude_vector" in key else key] = p.grad
    return grads


@pytest.mark.parametrize(("case", "targets"), [pytest.param(*c.values[:2], id=c.id) for c in CASES])
def test_dora_rslora_adapter_gradients_and_merge_match_peft(
    case: ParityCase, targets: list[str], tmp_path: Path
) -> None:
    """``use_dora`` + ``use_rslora``: logits as PEFT's (1e-5); adapter and magnitude gradients as PEFT's (max
    difference <= 1e-4 of the largest element; with the norm not detached they differ by 0.1); the merged
    export gives the DoRA model's logits (1e-5) and equals PEFT's ``merge_and_unload`` weights (1e-6)."""
    source = tmp_path / "hf"
    hf_model = make_hf_checkpoint(case, source)
    cfg = LoRASection(rank=4, alpha=8.0, target_modules=targets, use_dora=True, use_rslora=True)
    model, args, adapter = _lora_model_from_hf(source, case, cfg)
    assert all(module.lora_scale == 8.0 / 2 for _, module in lora_modules(model))  # alpha / sqrt(rank)
    tokens = random_tokens(VOCAB, case.seq_len)
    weights = torch.randn(1, case.seq_len, VOCAB, generator=torch.Generator().manual_seed(3))
    ours = model(tokens)
    (ours * weights).sum().backward()

    if case.model == "phi3" and targets != ["attention", "mlp"]:  # PEFT would rescale the rows we did not adapt
        with pytest.raises(ValueError, match="needs all of them in lora.target_modules"):
            export_peft_adapter(model, adapter, args, cfg, tmp_path / "adapter")
        return
    out = export_peft_adapter(model, adapter, args, cfg, tmp_path / "adapter", base_model_name_or_path=str(source))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["use_dora"] is True and config["use_rslora"] is True
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert {key.removesuffix(".weight").rsplit(".", 1)[-1] for key in keys} == {
        "lora_A",
        "lora_B",
        "lora_magnitude_vector",
    }

    with_adapter = peft.PeftModel.from_pretrained(hf_model, out, is_trainable=True)
    theirs = with_adapter(input_ids=tokens).logits
    diff = (theirs - ours).abs().max().item()
    assert diff <= ATOL, f"{case.id}: PEFT DoRA logits differ by {diff:.2e}"
    (theirs * weights).sum().backward()
    expected = _peft_grads(with_adapter)
    grads = peft_state_dict({k: p.grad for k, p in lora_state_dict(model).items()}, adapter, args)
    assert set(grads) == set(expected) == keys
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
        exported = {key: f.get_tensor(key) for key in keys}
    for key, grad in grads.items():
        if key.endswith("lora_B.weight"):  # a fused module's stacked B is block diagonal in ours, full in PEFT's
            expected[key] = torch.where(exported[key] == 0, 0.0, expected[key])
        error = ((grad - expected[key]).abs().max() / expected[key].abs().max()).item()
        assert error <= 1e-4, f"{case.id}: {key} gradient differs by {error:.1e} of its largest element"

    merged = export_hf(model, tmp_path / "merged", adapter, args, source_folder=source)
    reloaded = case.hf_model().from_pretrained(merged).eval()
    with torch.no_grad():
        diff = (reloaded(input_ids=tokens).logits - ours).abs().max().item()
        assert diff <= ATOL, f"{case.id}: merged DoRA export logits differ by {diff:.2e}"
        peft_merged = with_adapter.merge_and_unload().state_dict()
        for key, value in reloaded.state_dict().items():
            torch.testing.assert_close(value, peft_merged[key], rtol=0, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
