"""LoRA SFT in the trainer: adapter-only checkpoints, the base reloaded on resume, the PEFT export at the end."""

from __future__ import annotations

import json

import torch
import torch.distributed.checkpoint as dcp

from tests.helpers import scalars, tiny_args, train_until_first_save
from titanium.parallel.distributed import shutdown_distributed

SFT = (
    "--training.objective", "sft",
    "--data.kind", "chat",
    "--data.path", "assets/tasks/arithmetic/train.jsonl",
    "--chat.chat_template", "llama3",
    "--optimizer.lr", "3e-3",
    "--debug.deterministic",
)  # fmt: skip


def test_lora_resume_from_adapter_checkpoint(make_trainer, tmp_path):
    """A LoRA run started from a pretrained titanium checkpoint, killed after its step-3 save and resumed,
    logs the uninterrupted run's losses for steps 4-6 exactly. Its checkpoints hold only the adapters,
    so this also shows the base being read again from initial_load_path on resume."""
    pretrain = make_trainer(*tiny_args(tmp_path / "pre", "--training.steps", "2", "--checkpoint.enable"))
    pretrain.train()
    pretrain.close()
    shutdown_distributed()
    lora = (
        *SFT,
        "--lora.rank", "4",
        "--training.steps", "6",
        "--checkpoint.enable",
        "--checkpoint.interval", "3",
        "--checkpoint.initial_load_path", str(tmp_path / "pre/checkpoint/step-2"),
    )  # fmt: skip
    straight = make_trainer(*tiny_args(tmp_path / "straight", *lora))
    straight.train()
    expected = scalars(tmp_path / "straight/tb")
    straight.close()
    shutdown_distributed()

    train_until_first_save(make_trainer, *tiny_args(tmp_path / "resumed", *lora))  # dies after its step-3 checkpoint

    saved = dcp.FileSystemReader(str(tmp_path / "resumed/checkpoint/step-3")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_a." in k or ".lora_b." in k for k in model_keys), model_keys[:5]

    resumed = make_trainer(*tiny_args(tmp_path / "resumed", *lora))
    assert resumed.train_state.step == 3
    resumed.train()
    got = scalars(tmp_path / "resumed/tb")
    assert [got[s] for s in (4, 5, 6)] == [expected[s] for s in (4, 5, 6)]

    config = json.loads((tmp_path / "resumed/adapter/adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA"
    assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]


def test_lora_base_stays_frozen_and_qlora_trains(make_trainer, tmp_path):
    """Only adapters (here DoRA's: magnitudes too) change in a LoRA step, and the PEFT export says DoRA; with an
    NF4 base (QLoRA, CPU) the loss still falls."""
    dora = ("--lora.rank", "4", "--lora.use_dora", "--training.steps", "1")
    trainer = make_trainer(*tiny_args(tmp_path / "lora", *SFT, *dora))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert all(".lora_" in n for n in changed), sorted(changed)[:5]  # the base is untouched
    assert any(".lora_b." in n for n in changed)  # B starts at zero, so its first step moves it
    assert any(n.endswith(".lora_magnitude") for n in changed)
    trainer.close()
    assert json.loads((tmp_path / "lora/adapter/adapter_config.json").read_text())["use_dora"] is True
    shutdown_distributed()

    qlora = (*SFT, "--lora.rank", "8", "--lora.quantize_base", "nf4", "--training.steps", "12")
    trainer = make_trainer(*tiny_args(tmp_path / "qlora", *qlora, "--lr_scheduler.warmup_steps", "2"))
    trainer.train()
    losses = scalars(tmp_path / "qlora/tb")
    assert losses[12] < losses[1] - 1.0, losses
