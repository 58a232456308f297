"""The sections of the objectives trained on rollouts ([grpo], [online_dpo], [ppo]), each with the checks of its own
settings and of what it needs of the job (``problems``), run when the job's objective reads the section."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from titanium.config.preference_sections import DPO_LOSSES


@dataclass
class GRPOSection:
    group_size: int = 8
    """Responses sampled per prompt. Each response's advantage compares its reward with the others of
    its group (TRL's num_generations); at least 2."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantage = reward - mean of its group, divided by the group's standard deviation (group, the GRPO
    paper), by that of the whole batch (batch), or not divided (none, as in Dr. GRPO)."""
    epsilon_low: float = 0.2
    """Lower clip of the probability ratio: a token whose ratio fell below 1 - epsilon_low with a negative
    advantage gets no further push."""
    epsilon_high: float = 0.2
    """Upper clip of the ratio: no further push above 1 + epsilon_high with a positive advantage (DAPO's
    clip-higher uses 0.28)."""
    beta: float = 0.0
    """Weight of the KL penalty to a frozen reference policy (k3 estimator). 0 (TRL's default) builds no
    reference model; the GRPO paper used 0.04."""
    loss_type: Literal["dapo", "grpo", "dr_grpo", "bnpo", "gspo", "cispo"] = "dapo"
    """The loss variant, each equal to TRL's GRPOTrainer loss_type of the same name. dapo: every token of the step
    weighs the same (sum over the step's loss tokens / their count over all ranks). grpo: each response's mean over
    its tokens, averaged over the step's responses (a response masked by mask_truncated still counts, as a 0).
    dr_grpo: sum over tokens / (responses x max_new_tokens), a constant (Dr. GRPO; pair it with scale_rewards
    none). bnpo: each microbatch's token mean, averaged over the step's microbatches. gspo: one clipped ratio per
    response, the geometric mean of its token ratios, normalized as grpo (GSPO). cispo: -sg(min(ratio, cispo_cap))
    x advantage x log-prob per token, normalized as dapo (CISPO: no token loses its gradient)."""
    delta: float | None = None
    """Two-sided clipping (INTELLECT-2): the unclipped term's ratio is capped at delta (> 1; TRL recommends more
    than 1 + epsilon_high), so a negative-advantage token whose ratio ran far above 1 gets a bounded push.
    Unset: off. Not for cispo."""
    kl_bias_correction: bool = False
    """With beta > 0: multiply each token's k3 KL by its importance ratio (DeepSeek-V3.2; TRL's
    use_bias_correction_kl, on by default there), which makes the KL's gradient the unbiased reverse-KL gradient
    for rollouts of an older policy. The KL metric stays the plain k3 estimate."""
    cispo_cap: float = 5.0
    """loss_type cispo: the cap on each token's importance weight (TRL's epsilon_high under cispo; ScaleRL
    uses 5.0)."""
    old_logprobs: Literal["sampler", "recompute"] = "sampler"
    """The old policy's log-probs in the ratio. sampler: those the rollout engine reported for its tokens.
    recompute: a no-grad forward of the trained policy over the rollouts before their first step (TRL's
    default), so the ratio is exactly 1 there; the engine's log-probs are kept for is_correction."""
    is_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "none"
    """Importance weights for the engine/trainer mismatch (needs old_logprobs recompute), as TRL's
    vllm_importance_sampling_mode: the ratio exp(recomputed - engine log-prob) per token, or its product over a
    response (sequence), truncated to [is_cap_min, is_cap] or masked to 0 outside it; it multiplies the policy
    loss."""
    is_cap: float = 3.0
    """Upper bound of the importance weight (TRL's vllm_importance_sampling_clip_max)."""
    is_cap_min: float | None = None
    """Lower bound of the importance weight (TRL's vllm_importance_sampling_clip_min); unset: none."""
    ppo_epochs: int = 1
    """Passes over each batch of rollouts (TRL's num_iterations); the ratio and its clipping only matter
    from the second optimizer step on the same rollouts."""
    minibatches: int = 1
    """Optimizer steps per pass over a batch of rollouts: each rank generates this many steps' worth of
    responses (training.global_batch_size each over all ranks) in one go, then trains on one part per step."""
    mask_truncated: bool = False
    """Leave responses cut at max_new_tokens out of the loss (DAPO's overlong filtering); they still count
    as responses for loss_type grpo and gspo and dr_grpo (as in TRL)."""

    def problems(self, job: Any) -> Iterator[str]:
        """This section's ranges, and what GRPO needs of the job: whole groups per microbatch, no LoRA dropout, and
        the full-vocabulary log-probs its loss compares with."""
        if self.group_size < 2:
            yield (
                "--grpo.group_size must be >= 2 (advantages compare the responses to one prompt), got "
                f"{self.group_size}"
            )
        for name in ("ppo_epochs", "minibatches"):
            if (value := getattr(self, name)) < 1:
                yield f"--grpo.{name} must be >= 1, got {value}"
        if not 0 <= self.epsilon_low < 1:
            yield f"--grpo.epsilon_low must be in [0, 1), got {self.epsilon_low}"
        for name in ("epsilon_high", "beta"):
            if (value := getattr(self, name)) < 0:
                yield f"--grpo.{name} must be >= 0, got {value}"
        if self.delta is not None and self.loss_type == "cispo":
            yield (
                "--grpo.delta caps the clipped objective's ratio; --grpo.loss_type cispo has none (use "
                "--grpo.cispo_cap)"
            )
        elif self.delta is not None and self.delta <= 1:
            yield (
                f"--grpo.delta must be > 1 (TRL recommends > 1 + epsilon_high), got {self.delta}: a cap at or below 1 "
                "takes the gradient from on-policy tokens with a negative advantage"
            )
        if self.cispo_cap <= 0:
            yield f"--grpo.cispo_cap must be > 0 (it caps the importance weight), got {self.cispo_cap}"
        if self.is_correction != "none" and self.old_logprobs != "recompute":
            yield (
                f"--grpo.is_correction {self.is_correction} weighs by exp(recomputed - engine log-prob): it needs "
                "--grpo.old_logprobs recompute (with the engine's own log-probs as the old ones every weight is 1)"
            )
        if self.is_cap <= 0 or (self.is_cap_min is not None and not 0 <= self.is_cap_min < self.is_cap):
            yield f"--grpo.is_cap_min {self.is_cap_min} / --grpo.is_cap {self.is_cap}: need 0 <= is_cap_min < is_cap"
        yield from self._job_problems(job)

    def _job_problems(self, job: Any) -> Iterator[str]:
        t, rl = job.training, job.rl
        if t.local_batch_size % self.group_size:
            yield (
                f"--training.local_batch_size {t.local_batch_size} (responses per microbatch) must be a multiple of "
                f"--grpo.group_size {self.group_size}, so that each group of responses stays in one microbatch"
            )
        if job.lora.rank > 0 and job.lora.dropout > 0:
            yield (
                f"--lora.dropout {job.lora.dropout}: --training.objective grpo compares the training forward with "
                "the forward that gave the old log-probs (rollouts run without dropout), so dropout would move every "
                "ratio away from 1 by noise; set --lora.dropout 0"
            )
        if job.rollout.engine == "vllm" and (rl.top_k > 0 or rl.top_p < 1) and self.old_logprobs != "recompute":
            yield (
                f"--rollout.engine vllm with --rl.top_k {rl.top_k} / --rl.top_p {rl.top_p}: vLLM reports the "
                "log-probs of the truncated distribution it sampled from, not the full-vocabulary ones the loss uses; "
                "set --grpo.old_logprobs recompute (or turn top_k / top_p off)"
            )


@dataclass
class OnlineDPOSection:
    """Online DPO (TRL's OnlineDPOTrainer): two responses sampled per prompt from the rollout source ([rl]), ranked
    by their rewards, and a DPO loss on the pair against the frozen reference."""

    beta: float = 0.1
    """The DPO temperature: the implicit reward is beta x (log pi - log pi_ref) of a response."""
    loss_type: str = "sigmoid"
    """The pair loss, a --dpo.loss_type that compares log-ratios to the reference: sigmoid (DPO, TRL's default),
    ipo (TRL's other choice), hinge, robust or bco_pair."""
    missing_eos_penalty: float = 0.0
    """Subtracted from the reward of a response cut at max_new_tokens without a stop token before the pair is
    ranked (TRL's missing_eos_penalty); 0: none."""

    def problems(self, job: Any) -> Iterator[str]:
        """This section's ranges, and what online DPO needs: a loss on log-ratios to a reference, whole pairs."""
        if self.beta <= 0:
            yield f"--online_dpo.beta must be > 0, got {self.beta}"
        if self.missing_eos_penalty < 0:
            yield f"--online_dpo.missing_eos_penalty must be >= 0, got {self.missing_eos_penalty}"
        if DPO_LOSSES.known(self.loss_type) and not getattr(DPO_LOSSES.load(self.loss_type), "reference", True):
            yield (
                f"--online_dpo.loss_type {self.loss_type} needs no reference; online DPO compares to one: use sigmoid "
                "(TRL's default), ipo, hinge, robust or bco_pair"
            )
        if (rows := job.training.local_batch_size) % 2:
            yield f"--training.local_batch_size {rows}: online DPO needs whole pairs (an even number)"


@dataclass
class PPOSection:
    value_model_path: str = ""
    """Where the value model (critic) starts: a Hugging Face sequence-classification folder. Empty: the reward
    model's when --rl.rewards names exactly one (torchtune's recipe), else the policy's shape with a seeded scalar
    head and body."""
    value_lr: float = 1e-5
    """The value model's AdamW learning rate (constant; the policy follows [optimizer] and [lr_scheduler])."""
    value_max_norm: float = 1.0
    """Gradient-norm clip of the value model (its own; --training.max_norm clips the policy's)."""
    vf_coef: float = 0.1
    """Weight of the value loss in the summed loss (torchtune's value_coeff, TRL's vf_coef)."""
    kl_coef: float = 0.05
    """Per-token KL penalty to the frozen reference in the reward: -kl_coef x (logprob - ref logprob) on every
    response token. 0 builds no reference model."""
    gamma: float = 1.0
    """Discount of GAE."""
    lam: float = 0.95
    """GAE's lambda: 1 gives Monte-Carlo returns minus values, 0 one-step temporal differences."""
    epsilon: float = 0.2
    """Clip of the probability ratio in the policy loss, [1 - epsilon, 1 + epsilon]."""
    value_clip: float = 0.2
    """Clip of the value's change from its value at rollout time in the value loss (torchtune's
    value_clip_range, TRL's cliprange_value)."""
    ppo_epochs: int = 2
    """Passes over each batch of rollouts."""
    minibatches: int = 1
    """Optimizer steps per pass over a batch of rollouts (each training.global_batch_size responses)."""
    missing_eos_penalty: float = 0.0
    """Subtracted from the score of a response cut at max_new_tokens without a stop token (TRL's
    missing_eos_penalty, torchtune's reward_penalty); 0: none."""

    def problems(self, job: Any) -> Iterator[str]:
        """This section's ranges, its value model's folder, and what PPO cannot do yet."""
        for name in ("kl_coef", "vf_coef", "missing_eos_penalty"):
            if getattr(self, name) < 0:
                yield f"--ppo.{name} must be >= 0, got {getattr(self, name)}"
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                yield f"--ppo.{name} must be in [0, 1], got {getattr(self, name)}"
        for name in ("epsilon", "value_clip", "value_lr", "value_max_norm"):
            if not getattr(self, name) > 0:
                yield f"--ppo.{name} must be > 0, got {getattr(self, name)}"
        for name in ("ppo_epochs", "minibatches"):
            if getattr(self, name) < 1:
                yield f"--ppo.{name} must be >= 1, got {getattr(self, name)}"
        if self.value_model_path:
            yield from scalar_head_folder("--ppo.value_model_path", self.value_model_path)
        if job.rl.dynamic_sampling:
            yield (
                "--rl.dynamic_sampling drops groups of responses to one prompt whose rewards are all equal; PPO "
                "samples one response per prompt (no groups): turn it off"
            )
        if job.fault_tolerance.enable:
            yield "--fault_tolerance.enable with --training.objective ppo is not supported yet; turn it off"


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
