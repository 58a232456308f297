"""LoRA on the stacked experts of Qwen3-MoE: the PEFT adapter that ``peft`` loads onto ``transformers``'
``Qwen3MoeForCausalLM`` (LoRA on its stacked ``gate_up_proj``/``down_proj`` parameters, ``target_parameters``) and
the merged Hugging Face export both give the titanium model's logits (fp32, max abs diff 1e-5).

Random base, random non-zero ``lora_B`` of every adapter, so a wrong expert order (PEFT keeps A's rows expert-major
and B's columns expert-minor), a swapped gate/up part or a wrong nesting of the two wrapped parameters shows in
the logits. Experts with attention adapters; and with a dense layer's MLP (``mlp_only_layers``) adapted too,
whose PEFT export is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.parity.harness import make_hf_checkpoint, random_tokens
from tests.parity.test_moe_parity import VOCAB, qwen3_moe
from tests.parity.test_peft_export import _lora_model_from_hf
from titanium.checkpoint.hf import export_hf
from titanium.config.sections import LoRASection
from titanium.models.hf_adapter import HFExportError
from titanium.peft import export_peft_adapter

peft = pytest.importorskip("peft")

ATOL = 1e-5
CASES = [
    pytest.param(
        qwen3_moe("8e_top2", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
        ["attention", "experts"], id="experts_attention",
    ),
    pytest.param(
        qwen3_moe("6e_top3_dense", num_experts=6, num_experts_per_tok=3, moe_intermediate_size=36,
                  norm_topk_prob=False, mlp_only_layers=[1]),
        ["attention", "mlp", "experts"], id="experts_attention_dense_mlp",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("case", "targets"), CASES)
def test_expert_adapters_load_in_peft_and_merge(case, targets: list[str], tmp_path: Path) -> None:
    """With a dense layer's MLP adapted, the PEFT export is refused (peft would load those adapters onto the
    experts), and the merged export still matches."""
    source = tmp_path / "hf"
    hf_model = make_hf_checkpoint(case, source)
    cfg = LoRASection(rank=4, alpha=8.0, target_modules=targets)
    model, args, adapter = _lora_model_from_hf(source, case, cfg)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts.lora_b." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    tokens = random_tokens(VOCAB, case.seq_len)
    with torch.no_grad():
        ours = model(tokens)
        assert (ours - hf_model(input_ids=tokens).logits).abs().max() > 1e-2  # the adapters matter

    folder = tmp_path / "adapter"
    if "mlp" in targets:
        with pytest.raises(HFExportError, match=r"dense MLP layers \(down_proj, gate_proj, up_proj\)"):
            export_peft_adapter(model, adapter, args, cfg, folder)
    else:
        out = export_peft_adapter(model, adapter, args, cfg, folder, base_model_name_or_path=str(source))
        config = json.loads((out / "adapter_config.json").read_text())
        assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
        assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        assert config["rank_pattern"] == {"gate_up_proj": 8} and config["alpha_pattern"] == {"gate_up_proj": 16.0}
        with_adapter = peft.PeftModel.from_pretrained(hf_model, out).eval()
        with torch.no_grad():
            diff = (with_adapter(input_ids=tokens).logits - ours).abs().max().item()
        assert diff <= ATOL, f"PEFT adapter logits differ by {diff:.2e}"

    merged = export_hf(model, tmp_path / "merged", adapter, args, source_folder=source)
    reloaded = case.hf_model().from_pretrained(merged).eval()
    with torch.no_grad():
        diff = (reloaded(input_ids=tokens).logits - ours).abs().max().item()
    assert diff <= ATOL, f"merged export logits differ by {diff:.2e}"
