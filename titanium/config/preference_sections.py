"""The sections of the objectives trained on preference pairs or labelled completions ([dpo], [kto], [reward]),
each with the checks of its own settings (``problems``), run when the job's objective reads the section."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from titanium.config.dpo_losses import LOSS_KNOBS, RobustKnobs, SigmoidKnobs, SimPOKnobs
from titanium.config.registry import Registry
from titanium.config.sample_sections import PadToOption, pad_multiple_problems

DPO_LOSSES = Registry("DPO loss", "--dpo.loss_type")
"""Per-pair preference losses: a ``PairLoss`` (its function, its own parameters, what else it needs), or a plain
``(chosen, rejected, DPOSection) -> losses`` (titanium/objectives/losses/dpo.py)."""
DPO_LOSSES.register("sigmoid", "titanium.objectives.losses.dpo:SIGMOID")
DPO_LOSSES.register("ipo", "titanium.objectives.losses.dpo:IPO")
DPO_LOSSES.register("hinge", "titanium.objectives.losses.dpo:HINGE")
DPO_LOSSES.register("robust", "titanium.objectives.losses.dpo:ROBUST")
DPO_LOSSES.register("bco_pair", "titanium.objectives.losses.dpo:BCO_PAIR")
DPO_LOSSES.register("simpo", "titanium.objectives.losses.dpo:SIMPO")
DPO_LOSSES.register("orpo", "titanium.objectives.losses.dpo:ORPO")


@dataclass
class DPOSection:
    beta: float = 0.1
    """How strongly the policy is held to the reference: the loss sees beta x (policy - reference)
    log-ratio differences. Small beta lets the policy move far from the reference; for ipo it is the
    regularization strength tau (the target margin is 1 / (2 beta))."""
    loss_type: str = "sigmoid"
    """With h the chosen-minus-rejected log-ratio difference: sigmoid: DPO, -log sigmoid(beta h) (conservative
    DPO with [dpo.sigmoid] label_smoothing). ipo: (h - 1/(2 beta))^2 (IPO). hinge: max(0, 1 - beta h) (SLiC).
    robust: DPO unbiased under label noise [dpo.robust] label_smoothing. bco_pair: -log sigmoid(beta rho_chosen) -
    log sigmoid(-beta rho_rejected). Reference-free (no reference model is built), on each response's mean token
    log-prob m: simpo: -log sigmoid(beta (m_chosen - m_rejected) - gamma) (+ cpo_alpha NLL; [dpo.simpo]); orpo:
    -beta log sigmoid(log odds ratio) + the chosen sequence's token-mean NLL. Each equals TRL 1.16's
    (docs/post_training.md). A loss's own parameters are under [dpo.<loss_type>]. Or your own per-pair loss as
    'package.module:function', called as fn(chosen, rejected, dpo_section) with each side's log-ratio (see
    titanium/objectives/losses/dpo.py)."""
    length_normalize: bool = False
    """Use each response's mean token log-prob instead of its sum, so long responses do not dominate
    (with loss_type ipo this is what TRL's ipo does; simpo and orpo always do)."""
    rpo_alpha: float = 0.0
    """Weight of an extra NLL term on the chosen response (its mean token negative log-likelihood), as in
    RPO; 0 turns it off."""
    precompute_reference: bool = False
    """Compute the reference policy's log-probs once over the data (one pass, before training) and cache
    them on disk; training then never holds or runs the reference model. The cache is keyed by the
    reference weights, data content, tokenizer, chat template and seq_len: a change computes it again."""
    reference_cache_folder: str = "reference_logps"
    """Where precompute_reference keeps its caches (one file per key), relative to job.dump_folder."""
    packing: bool = False
    """Pack the chosen and rejected sequences of several pairs into each training.seq_len row (attention
    masked per sequence), so short pairs waste no padding; a microbatch then holds a varying number of
    whole pairs. Off: each microbatch is local_batch_size pairs, one padded row per response."""
    max_prompt_length: int = 0
    """A pair's prompt longer than this many tokens keeps only its last max_prompt_length tokens (cut from the
    left, BOS included, as TRL's max_prompt_length), before on_long_pair fits the pair to seq_len; counted as
    data/truncated_prompts. 0: no limit."""
    on_long_pair: Literal["truncate", "drop"] = "truncate"
    """A pair whose longer sequence exceeds training.seq_len is cut to fit (truncate: the prompt first,
    from its start but keeping at least half of seq_len, then both responses to the same length) or left
    out (drop); either is counted in the log."""
    pad_to: PadToOption = "auto"
    """How wide a microbatch's rows are. longest: the microbatch's longest row rounded up to a bucket (a few
    widths per doubling, so compile sees few shapes); short pairs stop paying for seq_len, with the same loss.
    seq_len: every row seq_len wide (fixed shapes). auto: longest, but seq_len under pipeline parallelism
    (whose schedule needs fixed shapes; longest asked for there is overridden with a warning)."""
    pad_multiple: int = 8
    """With pad_to longest: every row width is a multiple of this (8 suits tensor cores); under context or
    tensor parallelism it is raised to a multiple of 2 x cp and cp x tp as the sequence split needs."""
    share_prompt: bool = True
    """Run each pair as one row: its prompt once, then the chosen and the rejected response, each response
    seeing the prompt and itself (never the other), at the positions it has in its own sequence. The same
    log-probs as a row per sequence, from about half the tokens when the prompt is most of a pair (rows up to
    2 x seq_len wide; under context parallelism each cp rank gathers the rows' final hidden states for the
    loss). Off, and under pipeline parallelism (whose stage logits have no form of these rows yet): one row
    per sequence. Refused for an image-text model's pairs (not made exact with their images yet)."""
    sigmoid: SigmoidKnobs = field(default_factory=SigmoidKnobs)
    """loss_type sigmoid's own parameters."""
    robust: RobustKnobs = field(default_factory=RobustKnobs)
    """loss_type robust's own parameters."""
    simpo: SimPOKnobs = field(default_factory=SimPOKnobs)
    """loss_type simpo's own parameters."""

    def problems(self, job: Any) -> Iterator[str]:
        """This section's ranges, and which loss types take which knobs."""
        if not DPO_LOSSES.known(self.loss_type):
            yield (
                f"--dpo.loss_type {self.loss_type!r} is not a DPO loss; valid: {', '.join(DPO_LOSSES.names())}, or "
                "your own as 'package.module:function'"
            )
        if self.beta <= 0:
            yield f"--dpo.beta must be > 0, got {self.beta}"
        yield from self._knob_problems()
        if self.rpo_alpha < 0:
            yield f"--dpo.rpo_alpha must be >= 0 (0 turns the NLL term off), got {self.rpo_alpha}"
        if self.loss_type in ("simpo", "orpo"):
            if self.precompute_reference:
                yield f"--dpo.loss_type {self.loss_type} needs no reference model: set --dpo.precompute_reference false"
            if self.length_normalize:
                yield f"--dpo.loss_type {self.loss_type} always averages log-probs: set --dpo.length_normalize false"
        if self.max_prompt_length < 0:
            yield f"--dpo.max_prompt_length must be >= 0 (0: no limit), got {self.max_prompt_length}"
        yield from pad_multiple_problems("dpo", self.pad_multiple)

    def _knob_problems(self) -> Iterator[str]:
        """The loss's own parameters' checks; another loss's parameters set are refused, naming the loss."""
        for loss, cls in LOSS_KNOBS.items():
            knobs = getattr(self, loss)
            if loss == self.loss_type:
                yield from knobs.problems(f"--dpo.{loss}")
                continue
            changed = [f.name for f in fields(knobs) if getattr(knobs, f.name) != getattr(cls(), f.name)]
            if changed:
                yield (
                    f"--dpo.{loss}.{changed[0]} is read by --dpo.loss_type {loss} only, and this job's loss is "
                    f"{self.loss_type}: leave it out (or set --dpo.loss_type {loss})"
                )


@dataclass
class KTOSection:
    beta: float = 0.1
    """How strongly the policy is held to the reference: the loss sees beta x (policy - reference) log-ratios
    (TRL's KTOConfig default)."""
    desirable_weight: float = 1.0
    """Weight of a desirable example's loss. With n_d desirable and n_u undesirable examples, TRL suggests
    desirable_weight x n_d / (undesirable_weight x n_u) in [1, 4/3]."""
    undesirable_weight: float = 1.0
    """Weight of an undesirable example's loss."""
    loss_type: Literal["kto", "apo_zero_unpaired"] = "kto"
    """kto: 1 - sigmoid(beta (rho - z0)) for a desirable completion, 1 - sigmoid(beta (z0 - rho)) for an
    undesirable one, with rho the log-ratio and z0 the KL estimate from mismatched prompt/completion pairs of the
    step (clamped at 0). apo_zero_unpaired: the same without z0 (1 - sigmoid(beta rho), sigmoid(beta rho)); no
    mismatched pairs are run. Each equals TRL 1.16's KTOTrainer (docs/post_training.md)."""

    def problems(self, job: Any) -> Iterator[str]:
        """This section's ranges, and the microbatch its KL estimate needs."""
        if self.beta <= 0:
            yield f"--kto.beta must be > 0, got {self.beta}"
        for name in ("desirable_weight", "undesirable_weight"):
            if (weight := getattr(self, name)) <= 0:
                yield f"--kto.{name} must be > 0, got {weight}"
        if self.loss_type == "kto" and job.training.local_batch_size < 2:
            yield (
                f"--training.local_batch_size {job.training.local_batch_size}: --kto.loss_type kto estimates its KL "
                "term from each example's prompt with another example's completion in the microbatch, so it needs "
                "at least 2"
            )


@dataclass
class RewardSection:
    center_rewards_coefficient: float = 0.0
    """Adds this times (r_chosen + r_rejected)^2 per pair to the Bradley-Terry loss (Eisenstein et al. 2023): it
    pulls the scores towards zero mean, which the loss alone leaves free. 0: off."""
    on_long_pair: Literal["truncate", "drop"] = "truncate"
    """A pair whose longer sequence exceeds training.seq_len is cut to fit (truncate: the prompt first, then both
    responses) or left out (drop); either is counted in the log."""

    def problems(self, job: Any) -> Iterator[str]:
        """This section's ranges."""
        if (center := self.center_rewards_coefficient) < 0:
            yield f"--reward.center_rewards_coefficient must be >= 0 (0 turns it off), got {center}"
