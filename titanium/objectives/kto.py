"""KTO (Ethayarajh et al. 2024): unpaired completions, each desirable or not, against a frozen reference.

Each example's score is its log-ratio rho = log pi(y|x) - log pi_ref(y|x), log-probs summed over the completion's
tokens. With ``loss_type = "kto"`` the loss compares rho with a reference point z0, an estimate of
KL(pi || pi_ref) from **mismatched** pairs: each example's prompt with another example's completion
(titanium.data.unpaired: TRL's rotation by one within the microbatch). As in TRL, the policy runs those pairs
without gradient (``ctx.models.policy().forward``), the reference runs them too, and z0 = max(0, mean
log-ratio) is a constant. The formulas are titanium/objectives/losses/preference.py's ``kto_loss`` and
``kto_kl_estimate`` (equal to TRL 1.16's; tests/unit/test_preference_losses_trl.py).

z0 is the mean over every mismatched pair of the **step**: all its microbatches and data-parallel ranks, averaged
in ``prepare`` with one all-reduce. TRL takes the mean over each process's micro-batch and averages those over
processes, which is the same number when each process runs one micro-batch per step (no gradient
accumulation); with accumulation titanium's estimate uses the whole step's pairs. The loss unit is an example:
the loop divides the sum of the per-example losses by the step's example count, TRL's batch mean.

The reference is the policy as it started (without converters: LoRA's adapters switched off), a frozen model
handle built like DPO's. Rows are single sequences, right-padded, read with plain causal attention. Under context
parallelism each rank sums the log-probs of its part of every row (training and mismatched rows alike), and the
placement adds the parts over the context-parallel group (differentiably, as DPO does) before the loss and the KL
estimate, so every rank computes them from whole sequences.

An image-text model's rows carry their images (titanium.data.vision_unpaired): the policy and the reference read
every row's pixel values, the mismatched rows their prompt's, as TRL's vision collator pairs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titanium.batch import Batch, Fields, per_row, per_token
from titanium.config.loader import ConfigError
from titanium.config.sections import DataSection, KTOSection
from titanium.data.chat import build_chat_template
from titanium.data.meter import DataMeter
from titanium.data.unpaired import UnpairedBatchLoader, UnpairedDataset, mismatched_images
from titanium.data.vision import images_of
from titanium.data.vision_unpaired import VisionUnpairedDataset
from titanium.model_builder import ModelSource
from titanium.objectives.base import LoaderObjective, LossResult, ModelOutput, ObjectiveContext, Prepared
from titanium.objectives.dpo import token_logps
from titanium.objectives.losses.preference import kto_loss

METRICS = ("reward_chosen", "reward_rejected", "logp_chosen", "logp_rejected", "kl")
"""``kto/<name>`` on the log line: the means over the desirable (chosen) and undesirable (rejected) examples of
the step, and the KL estimate z0 (TRL's ``rewards/chosen``, ``rewards/rejected``, ``logps/*``, ``kl``)."""


@dataclass
class MismatchedFields(Fields):
    """The labels of the mismatched rows (their completion tokens)."""

    labels: torch.Tensor = per_token()

    def units(self) -> torch.Tensor:
        return torch.zeros((), dtype=torch.long)  # (never trained on)


@dataclass
class KTOFields(Fields):
    """An unpaired microbatch's fields: one example per row."""

    labels: torch.Tensor = per_token()
    desirable: torch.Tensor = per_row()
    """``[rows]`` bool: the completion is desirable."""
    reference_logps: torch.Tensor | None = per_token(default=None)
    """The reference's token log-probs, filled in ``prepare``."""
    mismatched: Batch[MismatchedFields] | None = None
    """The mismatched rows (CPU, as the data made them) until ``prepare`` has run them."""
    kl: torch.Tensor | None = None
    """The step's KL estimate (0-d, before the clamp), set by ``prepare``; None for apo_zero_unpaired."""

    def units(self) -> torch.Tensor:
        return torch.ones_like(self.desirable, dtype=torch.long).sum()


def kto_microbatch(rows: dict[str, torch.Tensor]) -> Batch[KTOFields]:
    """The typed batch of an UnpairedBatchLoader's rows (single sequences: plain causal attention), with their
    images where an image-text model's examples carry them (the mismatched rows read their prompts')."""
    images = images_of(rows)
    mismatched = Batch(rows["kl_input"], MismatchedFields(rows["kl_label"]), images=mismatched_images(rows, images))
    return Batch(rows["input"], KTOFields(rows["label"], rows["desirable"], mismatched=mismatched), images=images)


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's log-prob of its labels, summed over its tokens [rows] (this rank's part under CP)."""
    return token_logps(logits, labels).sum(-1)


class KTOObjective(LoaderObjective):
    """KTO on unpaired completions (``[data] kind = "unpaired"``), configured by ``[kto]``.

    ``training.local_batch_size`` examples per microbatch (one row each, plus as many mismatched rows run in
    ``prepare`` for the KL estimate). A pipeline microbatch keeps its rows' fields; the step's KL estimate rides
    along whole."""

    loss_unit = "examples"
    metric_names = tuple(f"kto/{name}" for name in METRICS)

    @classmethod
    def frozen_sources(
        cls, section: KTOSection, start: ModelSource, vocab_size: int | None, seq_len: int
    ) -> list[ModelSource]:
        return [start]  # (the reference: the policy as it started)

    def __init__(self, ctx: ObjectiveContext, data: DataSection, kto: KTOSection) -> None:
        if ctx.models is None:
            raise ConfigError(
                "--training.objective kto needs a frozen reference model (the policy as it started), and this run "
                "has none to give; train through titanium.train"
            )
        self.cfg, self.ctx = kto, ctx
        self.estimates_kl = kto.loss_type == "kto"
        if ctx.processor is not None:  # (an image-text model's rows go through its processor, with their images)
            self.examples: UnpairedDataset = VisionUnpairedDataset(
                data, ctx.processor, ctx.seq_len, ctx.chat.system_prompt, ctx.dp_rank, ctx.dp_world
            )
        else:
            template = build_chat_template(ctx.chat.chat_template, ctx.tokenizer, ctx.chat_format)
            self.examples = UnpairedDataset(
                data, template, ctx.seq_len, ctx.tokenizer.bos_id, ctx.chat.system_prompt, ctx.dp_rank, ctx.dp_world
            )
        pad_to = "seq_len" if ctx.fixed_shapes else "longest"
        self.loader = UnpairedBatchLoader(
            self.examples,
            ctx.local_batch_size,
            ctx.seq_len,
            ctx.tokenizer.pad_id,
            pad_to,
            math.lcm(8, ctx.sequence_multiple),
            layout=ctx.processor.layout if ctx.processor is not None else None,
        )
        self.meter = DataMeter(self.examples)
        self.reference = ctx.models.frozen()  # (the policy as it started, without converters: no LoRA)
        self.policy = ctx.models.policy() if self.estimates_kl else None

    def next_microbatch(self) -> Batch[KTOFields]:
        rows = next(self.loader)
        self.meter.add(rows)
        return kto_microbatch(rows)

    def prepare(self, microbatches: list[Batch[KTOFields]]) -> Prepared:
        totals = torch.zeros(2, device=self.ctx.device)  # (sum of the mismatched log-ratios, their count)
        for mb in microbatches:
            fields = mb.fields
            logits = self.reference(mb)
            if logits is not None:  # (pipeline ranks without the last stage get None)
                fields.reference_logps = token_logps(logits, fields.labels)
            if self.policy is not None:
                assert fields.mismatched is not None
                totals += self._mismatched_totals(self.ctx.placement.place(fields.mismatched))
            fields.mismatched = None
        if self.policy is not None:
            if dist.is_initialized() and dist.get_world_size() > 1:
                # Every rank of a data-parallel rank's layout adds the same sums: the ratio stays the mean.
                dist.all_reduce(totals)
            kl = totals[0] / totals[1].clamp(min=1)
            for mb in microbatches:
                mb.fields.kl = kl
        return Prepared(microbatches)

    def _mismatched_totals(self, batch: Batch[MismatchedFields]) -> torch.Tensor:
        """(sum over the rows of policy - reference log-prob, row count) of placed mismatched rows; zeros on
        pipeline ranks without the last stage."""
        assert self.policy is not None
        policy, reference = self.policy.forward(batch.model_inputs()), self.reference(batch)
        if policy is None or reference is None:
            return torch.zeros(2, device=self.ctx.device)
        labels = batch.fields.labels
        ratio = self.ctx.placement.add_parts(sequence_logps(policy, labels) - sequence_logps(reference, labels))
        return torch.stack([ratio.sum(), torch.tensor(float(batch.rows), device=ratio.device)])

    def loss(self, output: ModelOutput, batch: Batch[KTOFields]) -> LossResult:
        assert output.logits is not None
        fields = batch.fields
        assert fields.reference_logps is not None
        parts = torch.stack([sequence_logps(output.logits, fields.labels), fields.reference_logps.sum(-1)])
        policy, reference = self.ctx.placement.add_parts(parts).unbind()
        desirable = fields.desirable
        out = kto_loss(
            policy,
            reference,
            desirable,
            fields.kl,
            self.cfg.beta,
            self.cfg.desirable_weight,
            self.cfg.undesirable_weight,
            self.cfg.loss_type,
        )
        chosen, rejected = desirable.to(policy.dtype), (~desirable).to(policy.dtype)
        examples = chosen + rejected
        kl = fields.kl.clamp(min=0) if fields.kl is not None else policy.new_zeros(())
        logps = policy.detach()
        metrics = {
            "kto/reward_chosen": ((out.rewards * chosen).sum(), chosen.sum()),
            "kto/reward_rejected": ((out.rewards * rejected).sum(), rejected.sum()),
            "kto/logp_chosen": ((logps * chosen).sum(), chosen.sum()),
            "kto/logp_rejected": ((logps * rejected).sum(), rejected.sum()),
            "kto/kl": (kl * examples.sum(), examples.sum()),
        }
        return LossResult(out.losses.sum(), metrics)
