"""Config checks of the reward, kd and ppo objectives: bad ranges and the layouts they cannot run under, named before
any process group exists (exit code 2)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def validate_reward(cfg: Any) -> Iterator[str]:
    if (center := cfg.reward.center_rewards_coefficient) < 0:
        yield f"--reward.center_rewards_coefficient must be >= 0 (0 turns it off), got {center}"


def validate_kd(cfg: Any) -> Iterator[str]:
    kd = cfg.kd
    if not 0 <= kd.alpha <= 1:
        yield f"--kd.alpha must be in [0, 1] (0: SFT, 1: distillation alone), got {kd.alpha}"
    if not kd.temperature > 0:
        yield f"--kd.temperature must be > 0, got {kd.temperature}"
    if not 0 <= kd.beta <= 1:
        yield f"--kd.beta must be in [0, 1], got {kd.beta}"
    if kd.chunk_size < 1:
        yield f"--kd.chunk_size must be >= 1, got {kd.chunk_size}"
    if cfg.training.objective != "kd":
        return
    if not kd.teacher_path:
        yield "--kd.teacher_path is required: the teacher's Hugging Face folder or titanium checkpoint step folder"


def validate_kto(cfg: Any) -> Iterator[str]:
    kto, objective = cfg.kto, cfg.training.objective
    if cfg.data.kind == "unpaired" and objective != "kto":
        yield f"--data.kind unpaired (labelled completions) needs --training.objective kto, not {objective}"
    if kto.beta <= 0:
        yield f"--kto.beta must be > 0, got {kto.beta}"
    for name in ("desirable_weight", "undesirable_weight"):
        if (weight := getattr(kto, name)) <= 0:
            yield f"--kto.{name} must be > 0, got {weight}"
    if objective != "kto":
        return
    if kto.loss_type == "kto" and cfg.training.local_batch_size < 2:
        yield (
            f"--training.local_batch_size {cfg.training.local_batch_size}: --kto.loss_type kto estimates its KL term "
            "from each example's prompt with another example's completion in the microbatch, so it needs at least 2"
        )
    if cfg.training.loss_chunk_size:
        yield "--training.loss_chunk_size applies to token cross-entropy (pretrain, sft), not to kto; set it to 0"


def validate_online_dpo(cfg: Any, loss_needs_reference: Any) -> Iterator[str]:
    """``loss_needs_reference(name)``: whether the DPO loss ``name`` compares log-ratios to a reference."""
    online, t = cfg.online_dpo, cfg.training
    if online.beta <= 0:
        yield f"--online_dpo.beta must be > 0, got {online.beta}"
    if online.missing_eos_penalty < 0:
        yield f"--online_dpo.missing_eos_penalty must be >= 0, got {online.missing_eos_penalty}"
    if t.objective != "online_dpo":
        return
    if not loss_needs_reference(online.loss_type):
        yield (
            f"--online_dpo.loss_type {online.loss_type} needs no reference; online DPO compares to one: use sigmoid "
            "(TRL's default), ipo, hinge, robust or bco_pair"
        )
    if t.local_batch_size % 2:
        yield f"--training.local_batch_size {t.local_batch_size}: online DPO needs whole pairs (an even number)"
    if t.loss_chunk_size:
        yield "--training.loss_chunk_size applies to token cross-entropy (pretrain, sft), not to online_dpo; set 0"
    if cfg.validation.interval > 0:
        yield (
            "--validation.interval: held-out loss has no meaning for --training.objective online_dpo (its loss needs "
            "rollouts); set it to 0 and measure held-out accuracy with --eval.interval"
        )


def _ppo_ranges(ppo: Any) -> Iterator[str]:
    for name in ("kl_coef", "vf_coef", "missing_eos_penalty"):
        if getattr(ppo, name) < 0:
            yield f"--ppo.{name} must be >= 0, got {getattr(ppo, name)}"
    for name in ("gamma", "lam"):
        if not 0 <= getattr(ppo, name) <= 1:
            yield f"--ppo.{name} must be in [0, 1], got {getattr(ppo, name)}"
    for name in ("epsilon", "value_clip", "value_lr", "value_max_norm"):
        if not getattr(ppo, name) > 0:
            yield f"--ppo.{name} must be > 0, got {getattr(ppo, name)}"
    for name in ("ppo_epochs", "minibatches"):
        if getattr(ppo, name) < 1:
            yield f"--ppo.{name} must be >= 1, got {getattr(ppo, name)}"


def scalar_head_folder(option: str, path: str) -> Iterator[str]:
    """A Hugging Face sequence-classification folder with one label, or a message naming ``option``."""
    config = Path(path) / "config.json"
    try:
        hf = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        yield f"{option} {path}: no readable config.json ({e}); give a Hugging Face sequence-classification folder"
        return
    architectures = hf.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures) or hf.get("num_labels", 1) != 1:
        yield (
            f"{option} {path}: {config} is not a one-label sequence classifier (architectures {architectures}); "
            "a reward or value model needs a scalar head: train one with --training.objective reward and "
            "--checkpoint.last_save_in_hf"
        )


def validate_ppo(cfg: Any) -> Iterator[str]:
    ppo, t = cfg.ppo, cfg.training
    yield from _ppo_ranges(ppo)
    if t.objective != "ppo":
        return
    if ppo.value_model_path:
        yield from scalar_head_folder("--ppo.value_model_path", ppo.value_model_path)
    if cfg.rl.dynamic_sampling:
        yield (
            "--rl.dynamic_sampling drops groups of responses to one prompt whose rewards are all equal; PPO samples "
            "one response per prompt (no groups): turn it off"
        )
    if cfg.fault_tolerance.enable:
        yield "--fault_tolerance.enable with --training.objective ppo is not supported yet; turn fault tolerance off"
    if t.loss_chunk_size:
        yield "--training.loss_chunk_size applies to token cross-entropy (pretrain, sft), not to ppo; set it to 0"
    if cfg.validation.interval > 0:
        yield (
            "--validation.interval: held-out loss has no meaning for --training.objective ppo (its loss needs "
            "rollouts); set it to 0 and measure held-out accuracy with --eval.interval"
        )
