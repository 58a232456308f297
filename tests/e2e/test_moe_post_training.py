"""Post-training an MoE model end to end on CPU: SFT with LoRA adapters on the attention and the stacked experts of
``debugmodel_moe``.

The base (router and experts included) stays frozen, the adapters train (the experts' ones too), the auxiliary
load-balancing loss is still computed (its gradient reaches the adapters through the hidden states), and the adapter
is written in PEFT layout with Hugging Face names (the experts' on transformers' stacked ``gate_up_proj`` /
``down_proj``, as ``target_parameters``).
"""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from tests.helpers import REPO, scalars, tiny_args

SFT = (
    "--model.name", "qwen3_moe", "--model.flavor", "debugmodel_moe", "--training.objective", "sft",
    "--data.kind", "chat", "--data.path", str(REPO / "assets/tasks/arithmetic/train.jsonl"),
    "--chat.chat_template", "llama3", "--training.local_batch_size", "2", "--training.steps", "2",
)  # fmt: skip


def test_sft_with_lora_on_an_moe_model(make_trainer, tmp_path):
    lora = ("--lora.rank", "4", "--lora.target_modules", "attention", "experts")
    trainer = make_trainer(*tiny_args(tmp_path, *SFT, *lora))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert all(".lora_" in n and (".attention." in n or ".experts." in n) for n in changed), sorted(changed)[:5]
    assert {n for n in changed if ".experts.lora_b." in n}, sorted(changed)[:5]
    losses, aux = scalars(tmp_path / "tb"), scalars(tmp_path / "tb", "moe/aux_loss")
    assert sorted(losses) == [1, 2] and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert all(1.0 < v < 8.0 for v in aux.values()), aux  # top-2 of 8: 2.0 when perfectly balanced
    config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    with safe_open(str(tmp_path / "adapter/adapter_model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.3.mlp.experts.base_layer.lora_B.weight" in keys  # (gate_up_proj's)
    assert len(keys) == 4 * (4 + 2) * 2
