"""Direct preference optimization: per-response log-probs and the DPO objective (the loss: losses/dpo.py).

For a pair (prompt x, chosen y_w, rejected y_l), a policy pi and a frozen reference pi_ref, each side's
score is its log-ratio log pi(y|x) - log pi_ref(y|x), log-probs summed over the response tokens (or
averaged, with length_normalize); for a reference-free loss (SimPO, ORPO) it is log pi(y|x) averaged over the
response tokens, and no reference model is built. The per-pair loss of the two scores is ``--dpo.loss_type``'s
(titanium/objectives/losses/dpo.py: sigmoid, ipo, hinge, robust, bco_pair, simpo, orpo, or your own), plus,
with rpo_alpha > 0, rpo_alpha times the chosen response's mean token NLL (RPO, Pang et al. 2024). The
implicit rewards are beta x each side's score. Losses come back per pair, to be summed: the loop divides by
the global number of pairs, so every layout and accumulation gives the exact pair mean.

CPO-SimPO (cpo_alpha > 0) and ORPO add TRL's SFT term, a token mean of the chosen sequences' NLL. TRL takes
it per micro-batch; so does titanium, per microbatch, weighted by the microbatch's pairs (``chosen_nll``): with
equal microbatches (the padded layout) that is TRL's loss exactly, for any gradient accumulation and
data-parallel degree. Packed microbatches (varying pair counts) and pipeline microbatches (each its own token
mean) weigh it slightly differently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titanium.batch import Batch, Fields, per_row, per_token
from titanium.config.errors import ConfigError
from titanium.config.sections import DataSection, DPOSection
from titanium.data.chat import build_optional_chat_template
from titanium.data.meter import DataMeter
from titanium.data.packing import row_width
from titanium.data.preference import PreferenceDataset
from titanium.data.preference_batch import PairStream, PreferenceBatchLoader, group_rows, pair_slots
from titanium.data.vision import images_of
from titanium.data.vision_preference import VisionPreferenceDataset
from titanium.model_builder import ModelSource
from titanium.objectives.base import (
    IGNORE_INDEX,
    FrozenModel,
    JobFacts,
    LoaderObjective,
    LossResult,
    ModelOutput,
    Models,
    ObjectiveContext,
    Prepared,
)
from titanium.objectives.dpo_reference import (
    CachedReferencePairs,
    ReferenceCache,
    data_identity,
    load_or_compute,
    precompute,
    tokenizer_identity,
)
from titanium.objectives.losses.cross_entropy import capped, is_plain_linear, labelled_positions, whole_hidden
from titanium.objectives.losses.dpo import dpo_loss, pair_loss
from titanium.objectives.losses.preference import token_mean_nll

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


def projected_logps(
    hidden: torch.Tensor,
    project: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    index: torch.Tensor,
    sources: torch.Tensor | None = None,
) -> torch.Tensor:
    """``token_logps`` from final hidden states ``[rows, seq, dim]``, projected (``project``: hidden -> logits)
    only at the flat positions ``index`` (where a label counts); 0 elsewhere, as ``token_logps`` gives.
    ``sources`` (flat, aligned with ``index``): the hidden state predicting each of those labels, where it is not
    the label's own position (shared-prompt rows, titanium/data/preference_rows.py).

    A DPO response is a few tokens after a long prompt, so the output projection and the softmax over the
    vocabulary run on a small share of the positions (the response tokens) instead of all of them.
    """
    selected = hidden.flatten(0, 1).index_select(0, index if sources is None else sources)
    targets = labels.flatten().index_select(0, index)
    logps = -F.cross_entropy(project(selected).float(), targets, reduction="none")
    return logps.new_zeros(labels.numel()).index_copy(0, index, logps).view(labels.shape)


def linear_projection(weight: torch.Tensor, softcap: float | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden -> float32 logits by an output weight ``[vocab, dim]``, soft-capped as the decoder's forward does.
    A vocabulary-sharded (tensor-parallel) weight is gathered whole, differentiably."""
    weight = weight.full_tensor() if isinstance(weight, DTensor) else weight
    return lambda hidden: capped(F.linear(hidden.to(weight.dtype), weight).float(), softcap)


def policy_projection(output: ModelOutput) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """The policy's whole final hidden states and its projection to logits, from a ``loss_input = "hidden"``
    output. Under tensor parallelism the sequence-parallel hidden states and the vocabulary-sharded weight are
    gathered whole, differentiably (every tp rank computes the whole loss; each gets its shards' gradients). An
    output layer that is not a plain linear map (LoRA, float8 or QAT on ``output``) is called as a module."""
    layer = output.projection
    assert output.hidden is not None and layer is not None
    softcap = getattr(layer, "logit_softcap", None)  # (set by the decoder: Gemma 2's final cap)
    if is_plain_linear(layer):
        return whole_hidden(output.hidden), linear_projection(layer.weight, softcap)
    return whole_hidden(output.hidden), lambda selected: capped(layer(selected).float(), softcap)


def response_sums(values: torch.Tensor, response_ids: torch.Tensor, slots: int, group: int = 2) -> torch.Tensor:
    """Per-pair sums of per-token ``values`` [..., rows, seq] over each response's labels: [..., pairs, 2].

    ``response_ids`` [rows, seq] is the batch's (titanium.data.preference_batch): ``2m + side`` for the
    m-th pair of a row group (``group`` rows: 2, a row pair; 1, a shared-prompt row), -1 where there is no
    label. Pair ``g * slots + m`` is the m-th pair of row group g; column 0 is its chosen response, 1 its
    rejected one; a slot without a pair sums to 0. Padded and packed rows, and any run of whole row groups, sum
    the same way. Under context parallelism each rank sums its part of the sequences; the caller adds the parts
    over the cp group before any non-linearity.
    """
    rows, seq = response_ids.shape
    ids = response_ids.reshape(rows // group, group * seq)
    index = ids.clamp(min=0).expand(*values.shape[:-2], -1, -1)
    masked = torch.where(ids >= 0, values.reshape(*values.shape[:-2], rows // group, group * seq), 0.0)
    sums = values.new_zeros(*values.shape[:-2], rows // group, 2 * slots).scatter_add(-1, index, masked)
    return sums.view(*values.shape[:-2], rows // group * slots, 2)


@dataclass
class PreferenceFields(Fields):
    """A preference microbatch's own fields (titanium/data/preference_batch.py says how pairs lie in rows)."""

    labels: torch.Tensor = per_token()
    response_ids: torch.Tensor = per_token()
    """``2m + side`` where a label belongs to the m-th pair of its row group, -1 elsewhere."""
    pairs_per_row: torch.Tensor = per_row()
    reference_logps: torch.Tensor | None = per_token(default=None)
    """The reference's token log-probs: from the cache (precompute_reference), else filled in ``prepare``."""
    prompt_labels: torch.Tensor | None = per_token(default=None)
    """ORPO: the next token at the chosen sequences' unlabeled positions (titanium.data.preference_batch)."""
    label_sources: torch.Tensor | None = per_token(default=None)
    """Shared-prompt rows: the column whose hidden state predicts each label (None: the label's own column)."""
    label_index: torch.Tensor | None = None
    """The flat positions of ``learned()``'s labels, found in ``prepare`` (not under pipeline parallelism)."""
    source_index: torch.Tensor | None = None
    """With ``label_sources``: the flat positions of the hidden states predicting them, found with ``label_index``."""

    def learned(self) -> torch.Tensor:
        """The labels the policy's log-probs are taken at: the responses' (and ORPO's chosen prompts')."""
        if self.prompt_labels is None:
            return self.labels
        return torch.where(self.labels == IGNORE_INDEX, self.prompt_labels, self.labels)

    def units(self) -> torch.Tensor:
        return self.pairs_per_row.sum()


def pair_batch(rows: dict[str, torch.Tensor]) -> Batch[PreferenceFields]:
    """The typed batch of a PreferenceBatchLoader's rows."""
    fields = PreferenceFields(
        rows["label"],
        rows["response_ids"],
        rows["pairs_per_row"],
        reference_logps=rows.get("reference_logps"),
        prompt_labels=rows.get("prompt_labels"),
        label_sources=rows.get("label_sources"),
    )
    core = {"positions": rows["positions"], "document_ids": rows["document_ids"], "parent_ids": rows.get("parent_ids")}
    return Batch(rows["input"], fields, **core, images=images_of(rows))


def image_problems(cfg: DPOSection) -> list[str]:
    """What ``[dpo]`` asks that pairs with images cannot do (yet)."""
    problems = []
    if cfg.share_prompt:
        problems.append(
            "--dpo.share_prompt: a row holding a prompt once with both responses is not made exact with images (their "
            "per-token fields: Gemma 3's image blocks, Llama 3.2 Vision's cross-attention mask); set "
            "--dpo.no_share_prompt with an image-text model"
        )
    if cfg.max_prompt_length:
        problems.append(
            f"--dpo.max_prompt_length {cfg.max_prompt_length}: cutting a prompt's start would cut its image tokens; "
            "set 0 with an image-text model"
        )
    if cfg.precompute_reference and pair_loss(cfg).reference:
        problems.append(
            "--dpo.precompute_reference: the cache knows a pair by its tokens, not its images (TRL refuses it for "
            "vision data too); set --dpo.no_precompute_reference with an image-text model"
        )
    if pair_loss(cfg).nll_over_prompt:
        problems.append(
            f"--dpo.loss_type {cfg.loss_type}: its NLL over the chosen prompt would learn the image placeholder "
            "tokens; use another loss type with an image-text model"
        )
    return problems


class DPOObjective(LoaderObjective):
    """DPO on preference pairs (``[data] kind = "preference"``), configured by ``[dpo]``.

    The loss unit is a pair: ``training.local_batch_size`` pairs per microbatch (as many shared-prompt rows, or
    2 x as many rows of one sequence each, see titanium.data.preference_batch). The reference policy's token
    log-probs come from a frozen model handle (``ctx.models``) in ``prepare``, or, with ``precompute_reference``,
    from a cache made once before training (the reference model is released right after). Every field is
    row-aligned and each pair lies in one row group, so a pipeline microbatch computes the loss of its own pairs;
    under context parallelism each rank sums its part of every response (with shared-prompt rows projecting its
    labels from the gathered hidden states: a label's predicting column may lie on another rank), and the
    placement adds the parts (differentiably) before the loss.
    """

    trl_metric_names = {
        "dpo/reward_chosen": "rewards/chosen",
        "dpo/reward_rejected": "rewards/rejected",
        "dpo/margin": "rewards/margins",
        "dpo/accuracy": "rewards/accuracies",
        "dpo/logp_chosen": "logps/chosen",
        "dpo/logp_rejected": "logps/rejected",
        "dpo/nll_loss": "nll_loss",
        "dpo/log_odds_ratio": "log_odds_ratio",
        "dpo/log_odds_chosen": "log_odds_chosen",
    }

    loss_unit = "pairs"
    loss_input = "hidden"  # (the responses' positions alone are projected; logits under pipeline parallelism)

    @classmethod
    def frozen_sources(
        cls, section: DPOSection, start: ModelSource, vocab_size: int | None, seq_len: int
    ) -> list[ModelSource]:
        """The reference during training: none when reference-free or precomputed (released before the first step)."""
        return [start] if pair_loss(section).reference and not section.precompute_reference else []

    @classmethod
    def check_config(cls, section: DPOSection, job: JobFacts, **more: Any) -> None:
        """An image-text model's pairs (titanium.data.vision_preference) run one sequence a row, padded, with their
        images: what would cut or lose images, or is not made exact for them, is refused."""
        super().check_config(section, job, **more)
        if getattr(job.start.args, "reads_images", False):
            for problem in image_problems(section):
                raise ConfigError(problem)

    def __init__(self, ctx: ObjectiveContext, data: DataSection, dpo: DPOSection) -> None:
        self.cfg, self.ctx, self.data = dpo, ctx, data
        self.pair_loss = pair_loss(dpo)
        self.nll_weight = self.pair_loss.weight_of_nll(dpo)
        names = (*METRICS, *self.pair_loss.metrics, *(("nll_loss",) if self.nll_weight > 0 else ()))
        self.metric_names = tuple(f"dpo/{name}" for name in names)
        self.template = None
        if ctx.processor is None:  # (an image-text model's rows go through its processor's chat template)
            self.template = build_optional_chat_template(ctx.chat.chat_template, ctx.tokenizer, ctx.chat_format)
        self.pairs = self._pairs(ctx.dp_rank, ctx.dp_world)
        self.pad_to, self.pad_multiple = row_width(
            dpo.pad_to, dpo.pad_multiple, ctx.fixed_shapes, ctx.sequence_multiple, "--dpo.pad_to"
        )
        self.pipelined = ctx.fixed_shapes
        """Pipeline parallelism: the loss gets the last stage's logits (and the reference gives its logits)."""
        self.shared = dpo.share_prompt and not self.pipelined
        """Shared-prompt rows (``--dpo.share_prompt``; not under pipeline parallelism, see its help)."""
        self.slots, self.group = pair_slots(ctx.seq_len, dpo.packing, self.shared), group_rows(self.shared)
        if self.pipelined:
            self.loss_input = "logits"
        self.reference: FrozenModel | None = None
        self._reference_project: Callable[[torch.Tensor], torch.Tensor] | None = None
        """The reference's output projection (its weight copied once: frozen), while ``reference`` is set."""
        stream: PairStream = self.pairs
        if self.pair_loss.reference and dpo.precompute_reference:
            stream = CachedReferencePairs(self.pairs, self._reference_cache)
        elif self.pair_loss.reference:  # (SimPO, ORPO: neither a reference model nor a cache)
            self.reference = self._models().frozen()  # (the policy as it started, without converters: no LoRA)
        self.loader = self._loader(stream)
        self.meter = DataMeter(self.pairs)

    def _pairs(self, dp_rank: int, dp_world: int) -> PreferenceDataset:
        ctx, dpo = self.ctx, self.cfg
        if ctx.processor is not None:
            return VisionPreferenceDataset(
                self.data, ctx.processor, ctx.seq_len, ctx.chat.system_prompt, dpo.on_long_pair, dp_rank, dp_world
            )
        return PreferenceDataset(
            self.data,
            self.template,
            ctx.seq_len,
            ctx.tokenizer.bos_id,
            ctx.chat.system_prompt,
            dpo.on_long_pair,
            dp_rank,
            dp_world,
            tokenizer=ctx.tokenizer,
            max_prompt_length=dpo.max_prompt_length,
        )

    def _loader(self, stream: PairStream) -> PreferenceBatchLoader:
        ctx = self.ctx
        return PreferenceBatchLoader(
            stream,
            ctx.local_batch_size,
            ctx.seq_len,
            ctx.tokenizer.pad_id,
            self.cfg.packing,
            self.pad_to,
            self.pad_multiple,
            prompt_labels=self.pair_loss.nll_over_prompt and self.nll_weight > 0,
            shared=self.shared,
            layout=ctx.processor.layout if ctx.processor is not None else None,
        )

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
            "max_prompt_length": self.cfg.max_prompt_length,
        }

        def compute() -> dict[bytes, tuple[float, float]]:
            self.reference = reference
            try:
                return precompute(self._pairs(0, 1), self._loader, self.reference_sums, ctx.dp_rank, ctx.dp_world)
            finally:
                self.reference, self._reference_project = None, None

        try:
            return load_or_compute(Path(ctx.dump_folder) / self.cfg.reference_cache_folder, identity, compute)
        finally:
            reference.release()

    @torch.no_grad()
    def reference_sums(self, rows: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The reference's (chosen, rejected) log-prob sums of each pair slot of a CPU microbatch [slots, 2]
        (the precompute pass), or None on pipeline ranks without the last stage."""
        batch = self.ctx.placement.place(pair_batch(rows))
        logps = self._reference_logps(self._find_labels(batch))
        if logps is None:
            return None
        return self.ctx.placement.add_parts(response_sums(logps, batch.fields.response_ids, self.slots, self.group))

    def _find_labels(self, batch: Batch[PreferenceFields]) -> Batch[PreferenceFields]:
        """The batch with the flat positions of its learned labels (``label_index``); not under pipeline
        parallelism, whose microbatches are cut into row slices. Found here, before the forward is queued, so
        the host sync their count needs waits only for the labels' copy to the device."""
        fields = batch.fields
        if not self.pipelined:
            fields.label_index = labelled_positions(fields.learned())
            if fields.label_sources is not None:  # (the same rows, the source columns of the whole sequences)
                width = fields.label_sources.shape[1]
                columns = fields.label_sources.flatten().index_select(0, fields.label_index)
                fields.source_index = fields.label_index // width * width * self.ctx.placement.parts + columns
        return batch

    def _reference_logps(self, batch: Batch[PreferenceFields]) -> torch.Tensor | None:
        """The reference's token log-probs at the batch's labels [rows, seq] (None on pipeline ranks without the
        last stage): from its hidden states projected at the labels only, or under pipeline parallelism from its
        logits."""
        assert self.reference is not None
        fields = batch.fields
        if self.pipelined:
            logits = self.reference(batch)
            return None if logits is None else token_logps(logits, fields.labels)
        if self._reference_project is None:
            self._reference_project = linear_projection(*self.reference.projection())
        assert fields.label_index is not None
        hidden = self._source_states(self.reference.hidden(batch), fields)
        return projected_logps(hidden, self._reference_project, fields.labels, fields.label_index, fields.source_index)

    def _source_states(self, hidden: torch.Tensor, fields: PreferenceFields) -> torch.Tensor:
        """The hidden states ``source_index`` points into: with shared-prompt rows under context parallelism a
        label's predicting column may lie on another rank (a response's first label, each part's first column),
        so the whole sequences' states, gathered differentiably; else this rank's own."""
        return hidden if fields.source_index is None else self.ctx.placement.whole_sequences(hidden)

    def next_microbatch(self) -> Batch[PreferenceFields]:
        rows = next(self.loader)
        self.meter.add(rows)
        return pair_batch(rows)

    def prepare(self, microbatches: list[Batch[PreferenceFields]]) -> Prepared:
        for mb in microbatches:
            self._find_labels(mb)
            if self.reference is not None:  # (cached: the batches carry reference_logps already)
                mb.fields.reference_logps = self._reference_logps(mb)
        return Prepared(microbatches)

    def loss(self, output: ModelOutput, batch: Batch[PreferenceFields]) -> LossResult:
        fields, reference = batch.fields, self.pair_loss.reference
        ids, labels = fields.response_ids, fields.learned()
        if output.logits is not None:  # (pipeline parallelism: the last stage's logits)
            logps = token_logps(output.logits, labels)
        else:
            assert fields.label_index is not None, "prepare finds the labels"
            hidden, project = policy_projection(output)
            hidden = self._source_states(hidden, fields)
            logps = projected_logps(hidden, project, labels, fields.label_index, fields.source_index)
        per_token = [logps, (ids >= 0).float()]
        if reference:
            assert fields.reference_logps is not None
            per_token.append(fields.reference_logps)
        sums = self.ctx.placement.add_parts(response_sums(torch.stack(per_token), ids, self.slots, self.group))
        policy, lengths, *ref = sums.unbind(0)
        present = lengths[:, 0] > 0  # slots that hold a pair
        references = ref[0].unbind(1) if reference else (None, None)
        out = dpo_loss(*policy.unbind(1), *references, self.cfg, *lengths.unbind(1), mask=present)
        pairs = present.sum()
        loss_sum = out.losses.sum()
        metrics = {f"dpo/{name}": (value, pairs) for name, value in out.metrics.items()}
        if self.nll_weight > 0:
            chosen = (ids >= 0) & (ids % 2 == 0)
            if fields.prompt_labels is not None:
                chosen |= fields.prompt_labels != IGNORE_INDEX
            chosen_sums = torch.stack([torch.where(chosen, logps, 0.0).sum(), chosen.sum().to(logps.dtype)])
            chosen_logp, chosen_tokens = self.ctx.placement.add_parts(chosen_sums).unbind()
            nll = token_mean_nll(chosen_logp, chosen_tokens) * pairs  # (TRL's micro-batch token mean, see above)
            loss_sum = loss_sum + self.nll_weight * nll
            metrics["dpo/nll_loss"] = (nll.detach(), pairs)
        return LossResult(loss_sum, metrics)
