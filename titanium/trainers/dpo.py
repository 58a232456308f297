"""Direct preference optimization: per-response log-probs, the preference losses and the DPO objective.

For a pair (prompt x, chosen y_w, rejected y_l), a policy pi and a frozen reference pi_ref, let
h = [log pi(y_w|x) - log pi_ref(y_w|x)] - [log pi(y_l|x) - log pi_ref(y_l|x)], log-probs summed over the
response tokens (or averaged, with length_normalize). The losses per pair are

- sigmoid (DPO, Rafailov et al. 2023): -log sigmoid(beta h); with label smoothing e (conservative DPO),
  -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h);
- ipo (Azar et al. 2023): (h - 1 / (2 beta))^2;
- hinge (SLiC, Zhao et al. 2023): max(0, 1 - beta h);
- or any loss registered in titanium/config/components.py's DPO_LOSSES, or given as ``module:function``;

plus, with rpo_alpha > 0, rpo_alpha times the chosen response's mean token NLL (RPO, Pang et al. 2024).
The implicit rewards are beta x each side's log-ratio. Losses come back per pair, to be summed: the
loop divides by the global number of pairs, so every layout and accumulation gives the exact pair mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titanium.batch import Batch, Fields, per_row, per_token
from titanium.config.components import DPO_LOSSES
from titanium.config.sections import DataSection, DPOSection
from titanium.data.chat import build_chat_template
from titanium.data.meter import DataMeter
from titanium.data.preference import PreferenceDataset
from titanium.data.preference_batch import PairStream, PreferenceBatchLoader, pair_slots
from titanium.trainers.base import (
    IGNORE_INDEX,
    FrozenModel,
    LossResult,
    ModelOutput,
    Models,
    Objective,
    ObjectiveContext,
    Prepared,
)
from titanium.trainers.dpo_reference import (
    CachedReferencePairs,
    ReferenceCache,
    data_identity,
    load_or_compute,
    precompute,
    tokenizer_identity,
)

METRICS = ("reward_chosen", "reward_rejected", "margin", "accuracy", "logp_chosen", "logp_rejected")
"""The per-pair metrics (sums over pairs in DPOLoss; ``dpo/<name>`` means on the log line)."""


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) at every position in float32, [batch, seq]; 0 where the label is IGNORE_INDEX.

    Under loss parallel (tensor parallelism) ``logits`` is vocabulary-sharded: the cross-entropy runs on
    the shards and only the [batch, seq] result is made whole.
    """
    flat = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX)
    if isinstance(flat, DTensor):
        flat = flat.full_tensor()
    return -flat.view(labels.shape)


def response_sums(values: torch.Tensor, response_ids: torch.Tensor, slots: int) -> torch.Tensor:
    """Per-pair sums of per-token ``values`` [..., rows, seq] over each response's labels: [..., pairs, 2].

    ``response_ids`` [rows, seq] is the batch's (titanium.data.preference_batch): ``2m + side`` for the
    m-th pair of a row pair, -1 where there is no label. Pair ``g * slots + m`` is the m-th pair of row pair
    g; column 0 is its chosen response, 1 its rejected one; a slot without a pair sums to 0. Padded and
    packed rows, and any run of whole row pairs, sum the same way. Under context parallelism each rank
    sums its part of the sequences; the caller adds the parts over the cp group before any non-linearity.
    """
    rows, seq = response_ids.shape
    ids = response_ids.reshape(rows // 2, 2 * seq)
    index = ids.clamp(min=0).expand(*values.shape[:-2], -1, -1)
    masked = torch.where(ids >= 0, values.reshape(*values.shape[:-2], rows // 2, 2 * seq), 0.0)
    sums = values.new_zeros(*values.shape[:-2], rows // 2, 2 * slots).scatter_add(-1, index, masked)
    return sums.view(*values.shape[:-2], rows // 2 * slots, 2)


@dataclass
class PreferenceFields(Fields):
    """A preference microbatch's own fields (titanium/data/preference_batch.py says how pairs lie in rows)."""

    labels: torch.Tensor = per_token()
    response_ids: torch.Tensor = per_token()
    """``2m + side`` where a label belongs to the m-th pair of its row pair, -1 elsewhere."""
    pairs_per_row: torch.Tensor = per_row()
    reference_logps: torch.Tensor | None = per_token(default=None)
    """The reference's token log-probs: from the cache (precompute_reference), else filled in ``prepare``."""

    def units(self) -> torch.Tensor:
        return self.pairs_per_row.sum()


def pair_batch(rows: dict[str, torch.Tensor]) -> Batch[PreferenceFields]:
    """The typed batch of a PreferenceBatchLoader's rows."""
    fields = PreferenceFields(
        rows["label"], rows["response_ids"], rows["pairs_per_row"], reference_logps=rows.get("reference_logps")
    )
    return Batch(rows["input"], fields, positions=rows["positions"], document_ids=rows["document_ids"])


@dataclass
class DPOLoss:
    losses: torch.Tensor
    """[pairs] per-pair losses (with gradient); sum them, the loop divides by the global pair count."""
    metrics: dict[str, torch.Tensor]
    """Sums over the pairs (detached 0-d tensors): divide by the global pair count to report means."""


def sigmoid_loss(h: torch.Tensor, cfg: DPOSection) -> torch.Tensor:
    """DPO (with label smoothing e: conservative DPO)."""
    eps, beta = cfg.label_smoothing, cfg.beta
    return -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)


def ipo_loss(h: torch.Tensor, cfg: DPOSection) -> torch.Tensor:
    return (h - 1 / (2 * cfg.beta)) ** 2


def hinge_loss(h: torch.Tensor, cfg: DPOSection) -> torch.Tensor:
    """SLiC."""
    return torch.relu(1 - cfg.beta * h)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    cfg: DPOSection,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> DPOLoss:
    """The loss of every pair from summed response log-probs ([pairs] each; see the module docstring).

    ``chosen_lengths``/``rejected_lengths`` (label tokens per response) are needed with length_normalize
    and with rpo_alpha > 0. The reference log-probs are treated as constants. ``mask`` (bool, [pairs])
    says which entries are pairs: the others (empty slots of a batch layout) get loss 0 and no metrics.
    """
    if (cfg.length_normalize or cfg.rpo_alpha > 0) and (chosen_lengths is None or rejected_lengths is None):
        raise ValueError("length_normalize and rpo_alpha need the response lengths")
    reference_chosen, reference_rejected = reference_chosen.detach(), reference_rejected.detach()
    chosen_nll = None
    if chosen_lengths is not None and rejected_lengths is not None:
        chosen_len, rejected_len = chosen_lengths.clamp(min=1), rejected_lengths.clamp(min=1)
        chosen_nll = -policy_chosen / chosen_len
        if cfg.length_normalize:
            policy_chosen, reference_chosen = policy_chosen / chosen_len, reference_chosen / chosen_len
            policy_rejected, reference_rejected = policy_rejected / rejected_len, reference_rejected / rejected_len
    chosen_ratio = policy_chosen - reference_chosen
    rejected_ratio = policy_rejected - reference_rejected
    h = chosen_ratio - rejected_ratio
    beta = cfg.beta
    losses = DPO_LOSSES.load(cfg.loss_type)(h, cfg)
    if cfg.rpo_alpha > 0:
        assert chosen_nll is not None
        losses = losses + cfg.rpo_alpha * chosen_nll
    weight = torch.ones_like(h) if mask is None else mask.to(h.dtype)
    chosen_rewards, rejected_rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    per_pair = {
        "reward_chosen": chosen_rewards,
        "reward_rejected": rejected_rewards,
        "margin": chosen_rewards - rejected_rewards,
        "accuracy": (chosen_rewards > rejected_rewards).to(h.dtype),
        "logp_chosen": policy_chosen.detach(),
        "logp_rejected": policy_rejected.detach(),
    }
    return DPOLoss(losses * weight, {name: (value * weight).sum() for name, value in per_pair.items()})


class DPOObjective(Objective):
    """DPO on preference pairs (``[data] kind = "preference"``), configured by ``[dpo]``.

    The loss unit is a pair: ``training.local_batch_size`` pairs per microbatch (2 x as many rows, see
    titanium.data.preference_batch). The reference policy's token log-probs come from a frozen model handle
    (``ctx.models``) in ``prepare``, or, with ``precompute_reference``, from a cache made once before training
    (the reference model is released right after). Every field is row-aligned and each pair lies in one row
    pair, so a pipeline microbatch computes the loss of its own pairs; under context parallelism each rank sums
    its part of every response, and the placement adds the parts (differentiably) before the loss.
    """

    metric_names = tuple(f"dpo/{name}" for name in METRICS)
    loss_unit = "pairs"

    def __init__(self, ctx: ObjectiveContext, data: DataSection, dpo: DPOSection) -> None:
        self.cfg, self.ctx, self.data = dpo, ctx, data
        self.template = build_chat_template(ctx.chat.chat_template, ctx.tokenizer, ctx.model_name)
        self.pairs = self._pairs(ctx.dp_rank, ctx.dp_world)
        self.slots = pair_slots(ctx.seq_len, dpo.packing)
        self.reference: FrozenModel | None = None
        stream: PairStream = self.pairs
        if dpo.precompute_reference:
            stream = CachedReferencePairs(self.pairs, self._reference_cache)
        else:
            self.reference = self._models().frozen()  # (the policy as it started, without converters: no LoRA)
        self.loader = self._loader(stream)
        self.meter = DataMeter(self.pairs)

    def _pairs(self, dp_rank: int, dp_world: int) -> PreferenceDataset:
        ctx, dpo = self.ctx, self.cfg
        return PreferenceDataset(
            self.data,
            self.template,
            ctx.seq_len,
            ctx.tokenizer.bos_id,
            ctx.chat.system_prompt,
            dpo.on_long_pair,
            dp_rank,
            dp_world,
        )

    def _loader(self, stream: PairStream) -> PreferenceBatchLoader:
        ctx = self.ctx
        return PreferenceBatchLoader(stream, ctx.local_batch_size, ctx.seq_len, ctx.tokenizer.pad_id, self.cfg.packing)

    def _models(self) -> Models:
        if self.ctx.models is None:
            raise ValueError("the dpo objective needs a reference: ObjectiveContext.models is not set")
        return self.ctx.models

    def _reference_cache(self) -> ReferenceCache:
        """The cached reference log-probs, read or computed when the first microbatch is asked for; the reference
        model is built only to compute them and released right after."""
        ctx = self.ctx
        reference = self._models().frozen()
        identity = {
            "reference": reference.id,
            "data": data_identity(self.data),
            "tokenizer": tokenizer_identity(ctx.tokenizer),
            "template": [ctx.chat.chat_template, type(self.template).__name__, ctx.chat.system_prompt],
            "seq_len": ctx.seq_len,
            "on_long_pair": self.cfg.on_long_pair,
        }

        def compute() -> dict[bytes, tuple[float, float]]:
            self.reference = reference
            try:
                return precompute(self._pairs(0, 1), self._loader, self.reference_sums, ctx.dp_rank, ctx.dp_world)
            finally:
                self.reference = None

        try:
            return load_or_compute(Path(ctx.dump_folder) / self.cfg.reference_cache_folder, identity, compute)
        finally:
            reference.release()

    @torch.no_grad()
    def reference_sums(self, rows: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The reference's (chosen, rejected) log-prob sums of each pair slot of a CPU microbatch [slots, 2]
        (the precompute pass), or None on pipeline ranks without the last stage."""
        assert self.reference is not None
        batch = self.ctx.placement.place(pair_batch(rows))
        logits = self.reference(batch)
        if logits is None:
            return None
        fields = batch.fields
        sums = response_sums(token_logps(logits, fields.labels), fields.response_ids, self.slots)
        return self.ctx.placement.add_parts(sums)

    def next_microbatch(self) -> Batch[PreferenceFields]:
        rows = next(self.loader)
        self.meter.add(rows)
        return pair_batch(rows)

    def prepare(self, microbatches: list[Batch[PreferenceFields]]) -> Prepared:
        if self.reference is not None:  # (cached: the batches carry reference_logps already)
            for mb in microbatches:
                logits = self.reference(mb)
                if logits is not None:  # (pipeline ranks without the last stage get None)
                    mb.fields.reference_logps = token_logps(logits, mb.fields.labels)
        return Prepared(microbatches)

    def loss(self, output: ModelOutput, batch: Batch[PreferenceFields]) -> LossResult:
        assert output.logits is not None
        fields = batch.fields
        ids = fields.response_ids
        assert fields.reference_logps is not None
        per_token = torch.stack([token_logps(output.logits, fields.labels), fields.reference_logps, (ids >= 0).float()])
        sums = self.ctx.placement.add_parts(response_sums(per_token, ids, self.slots))  # (whole responses)
        policy, reference, lengths = sums.unbind(0)
        present = lengths[:, 0] > 0  # slots that hold a pair
        out = dpo_loss(*policy.unbind(1), *reference.unbind(1), self.cfg, *lengths.unbind(1), mask=present)
        pairs = present.sum()
        return LossResult(out.losses.sum(), {f"dpo/{name}": (value, pairs) for name, value in out.metrics.items()})

    def log_metrics(self) -> dict[str, float]:
        return self.meter.metrics()

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
