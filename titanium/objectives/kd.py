"""Knowledge distillation: SFT data, a frozen teacher, and ``(1 - alpha) * CE + alpha * T^2 * D`` per labelled token.

The teacher (another size or family with the same vocabulary, from a Hugging Face folder or a titanium checkpoint)
is a frozen model handle: built by the job's ModelBuilder under the same plan as the student, without converters,
when first run. ``prepare`` runs it on each microbatch and keeps its final hidden states at the labelled positions
only; the loss projects both models' hidden states chunk by chunk (titanium/objectives/losses/distill.py), so neither
model's ``[tokens, vocab]`` logits exist whole. The teacher's output projection is gathered once (a whole copy
under FSDP: it never changes). The loss unit is a labelled token, as SFT's: with alpha = 0 the run is an SFT run.

Layouts. Under FSDP and context parallelism each rank projects the labelled tokens of its own rows or sequence
part. Under tensor parallelism the student's hidden states (sequence-parallel) and its vocabulary-sharded output
weight are gathered whole, differentiably, for the loss (every tp rank computes the same loss; the gradients go
back to each rank's shards); the chunked logits still never exist whole. Under pipeline parallelism the last
stage computes the student's logits whole and the teacher's pipeline, built by the same plan, gives its logits
on the same ranks: they are kept per row (a pipeline microbatch takes its rows) and the loss is taken from the
two logit tensors (``distillation_sum``), at the memory cost of the teacher's ``[rows, seq, vocab]`` logits of
the step.

Images. An image-text student (titanium/models/transformers/vision.py) trains on SFT rows with images
(titanium.data.vision_sft, one sample a row: ``--kd.no_packing``), and the teacher reads the same microbatch: the
same token ids, pixel values and image fields. So the teacher must be an image-text model whose processor makes the
same inputs from the rows (its class and settings, its tokenizer's vocabulary): ``check_teacher_processor``, before
start-up, refuses another, and ``teacher_source`` a text-only teacher.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from titanium.batch import Batch, per_token
from titanium.checkpoint.hf import hf_model_args
from titanium.config.loader import ConfigError
from titanium.config.sections import DataSection, KDSection, ModelSection, SFTSection
from titanium.data.vision import load_processor
from titanium.model_builder import ModelSource, WeightSource, resolve_spec
from titanium.models import build_model_args, get_model_spec, list_models
from titanium.objectives.base import JobFacts, LossResult, ModelOutput, Objective, ObjectiveContext, Prepared
from titanium.objectives.losses.cross_entropy import (
    TokenFields,
    labelled_positions,
    plain_projection_weight,
    whole_hidden,
)
from titanium.objectives.losses.distill import DistillSums, distillation_sum, linear_distillation_sum
from titanium.objectives.sft import SFTObjective

BETAS = {"forward_kl": 0.0, "reverse_kl": 1.0}
"""The divergences that fix the generalized JSD's beta (jsd takes [kd] beta)."""


@dataclass
class KDFields(TokenFields):
    """SFT's labels plus, after ``prepare``, the teacher's final hidden states at the labelled positions (or,
    under pipeline parallelism, its logits)."""

    teacher_hidden: torch.Tensor | None = None
    """``[labelled tokens, teacher dim]``, in the order of ``label_index`` (not under pipeline parallelism)."""
    teacher_logits: torch.Tensor | None = per_token(default=None)
    """Pipeline parallelism: ``[rows, seq, vocab]`` on the ranks of the last stage, None on the others."""


def teacher_source(
    kd: KDSection, student_model: str, vocab_size: int | None, seq_len: int, reads_images: bool = False
) -> ModelSource:
    """The teacher of ``[kd]``: its family, shape and weights; a teacher with another vocabulary than ``vocab_size``
    (the student's; None: not known yet, the pre-flight check), or one that reads no images for a student that does
    (``reads_images``), is refused."""
    folder = Path(kd.teacher_path)
    if not folder.is_dir():
        raise ConfigError(
            f"--kd.teacher_path {folder}: no such folder (a Hugging Face folder, or a titanium checkpoint's step-N)"
        )
    family = kd.teacher_model or student_model
    if family not in list_models():
        raise ConfigError(
            f"--kd.teacher_model {family!r} is not a known model; known models: {', '.join(list_models())}"
        )
    spec = get_model_spec(family)
    if (folder / "config.json").is_file():
        option = "--kd.teacher_path"
        spec = resolve_spec(ModelSection(name=family), folder)[0]  # (the backend's: as the folder's checkpoint names)
        args = hf_model_args(spec, folder, option=option, family_option="--kd.teacher_model", max_seq_len=seq_len)
        weights = WeightSource(hf_folder=str(folder), option=option)
    else:
        if not kd.teacher_flavor:
            raise ConfigError(
                f"--kd.teacher_path {folder} is a titanium checkpoint (no config.json): give its shape with "
                "--kd.teacher_flavor (and --kd.teacher_model if it is another family than the student's)"
            )
        if kd.teacher_flavor not in spec.flavors:
            raise ConfigError(
                f"--kd.teacher_flavor {kd.teacher_flavor!r} is not a flavor of {family}; valid flavors: "
                f"{', '.join(spec.flavors)} (or set --kd.teacher_model to the teacher's family)"
            )
        args = build_model_args(spec, kd.teacher_flavor, max_seq_len=seq_len)
        weights = WeightSource(dcp_folder=str(folder), option="--kd.teacher_path")
    if vocab_size is not None and args.vocab_size != vocab_size:
        raise ConfigError(
            f"--kd.teacher_path {folder}: the teacher's vocabulary has {args.vocab_size} entries, the student's "
            f"{vocab_size}; distillation compares next-token distributions, so both need the same tokenizer and "
            "vocabulary size"
        )
    if reads_images and not getattr(args, "reads_images", False):
        raise ConfigError(
            f"--kd.teacher_path {folder}: the student is an image-text model and trains on rows with images, and this "
            "teacher reads no images (a text-only model); give an image-text teacher with the student's processor"
        )
    return ModelSource(spec, args, weights)


def check_teacher_processor(kd: KDSection, student_folder: str) -> None:
    """An image-text student's teacher reads the model inputs the student's processor makes of each row (token ids,
    pixel values and the fields beside them), so its own processor must make the same: the same class and settings
    (image size, normalization, tiles, image tokens per image) and the same tokenizer vocabulary."""
    student = load_processor(student_folder, "the student's folder")
    teacher = load_processor(kd.teacher_path, "--kd.teacher_path")
    ours, theirs = student.to_dict(), teacher.to_dict()
    if type(student) is not type(teacher) or ours != theirs:
        differ = sorted(key for key in ours.keys() | theirs.keys() if ours.get(key) != theirs.get(key))
        raise ConfigError(
            f"--kd.teacher_path {kd.teacher_path}: its processor ({type(teacher).__name__}) would make other model "
            f"inputs from the rows than the student's ({type(student).__name__}, in {student_folder}): they differ in "
            f"{', '.join(differ) or 'their class'}; the teacher reads the student's pixel values and image tokens, so "
            "distil from a teacher with the student's processor"
        )
    if student.tokenizer.get_vocab() != teacher.tokenizer.get_vocab():
        raise ConfigError(
            f"--kd.teacher_path {kd.teacher_path}: its tokenizer's vocabulary is not the student's (in "
            f"{student_folder}); distillation compares next-token distributions, so both need the same tokenizer"
        )


class KDObjective(Objective):
    """Distillation from ``[kd] teacher_path`` on SFT data (chat, instruct or text rows, packed or padded)."""

    loss_input = "hidden"
    metric_names = ("kd/ce", "kd/divergence")

    @classmethod
    def frozen_sources(
        cls, section: KDSection, start: ModelSource, vocab_size: int | None, seq_len: int
    ) -> list[ModelSource]:
        reads_images = getattr(start.args, "reads_images", False)
        return [teacher_source(section, start.spec.name, vocab_size, seq_len, reads_images)]

    @classmethod
    def check_config(cls, section: KDSection, job: JobFacts, **more: Any) -> None:
        """The teacher resolves (``frozen_sources``); an image-text student's reads images, with its processor."""
        super().check_config(section, job, **more)
        if getattr(job.start.args, "reads_images", False) and job.start_folder is not None:
            check_teacher_processor(section, job.start_folder)

    def __init__(self, ctx: ObjectiveContext, data: DataSection, kd: KDSection) -> None:
        assert ctx.models is not None, "the kd objective needs model handles for its teacher"
        self.cfg, self.beta = kd, BETAS.get(kd.divergence, kd.beta)
        source = teacher_source(kd, ctx.model_name, ctx.vocab_size, ctx.seq_len, ctx.processor is not None)
        self.inner = SFTObjective(ctx, data, SFTSection(train_on_input=kd.train_on_input, packing=kd.packing))
        self.teacher = ctx.models.frozen(source=source)
        self._teacher_projection: tuple[torch.Tensor, float | None] | None = None
        self.pipelined = False
        """Whether the loss gets a pipeline's logits (``check_layout``) rather than hidden states."""

    def check_layout(self, pipeline_microbatch_size: int | None) -> None:
        self.pipelined = pipeline_microbatch_size is not None

    def next_microbatch(self) -> Batch[KDFields]:
        batch = self.inner.next_microbatch()
        fields = KDFields(batch.fields.labels)
        return Batch(batch.tokens, fields, batch.positions, batch.document_ids, images=batch.images)

    def prepare(self, microbatches: list[Batch[KDFields]]) -> Prepared:
        if self.pipelined:
            for mb in microbatches:
                mb.fields.teacher_logits = self.teacher(mb)
            return Prepared(microbatches)
        for mb in microbatches:
            fields = mb.fields
            fields.label_index = labelled_positions(fields.labels)
            fields.teacher_hidden = self.teacher.hidden(mb).flatten(0, 1).index_select(0, fields.label_index)
        if self._teacher_projection is None:  # (frozen: gathered once)
            self._teacher_projection = self.teacher.projection()
        return Prepared(microbatches)

    def loss(self, output: ModelOutput, batch: Batch[KDFields]) -> LossResult:
        sums = self._pipeline_sums(output, batch) if output.logits is not None else self._chunked_sums(output, batch)
        tokens = sums.tokens
        return LossResult(
            sums.loss, {"kd/ce": (sums.cross_entropy, tokens), "kd/divergence": (sums.divergence, tokens)}
        )

    def _pipeline_sums(self, output: ModelOutput, batch: Batch[KDFields]) -> DistillSums:
        """From the last pipeline stage's logits and the teacher's (see the module docstring)."""
        fields = batch.fields
        assert output.logits is not None and fields.teacher_logits is not None
        logits = output.logits
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits  # (loss parallel: differentiable)
        cfg = self.cfg
        return distillation_sum(
            logits, fields.teacher_logits, fields.labels, alpha=cfg.alpha, temperature=cfg.temperature, beta=self.beta
        )

    def _chunked_sums(self, output: ModelOutput, batch: Batch[KDFields]) -> DistillSums:
        """Chunk by chunk from both models' hidden states; under tensor parallelism from the student's whole
        hidden states and output weight, gathered differentiably (every tp rank then computes the whole loss, and
        the gradient each rank sends back is whole: Replicate, no partial sums)."""
        fields = batch.fields
        assert output.hidden is not None and output.projection is not None
        assert fields.label_index is not None and fields.teacher_hidden is not None and self._teacher_projection
        teacher_weight, teacher_softcap = self._teacher_projection
        hidden = whole_hidden(output.hidden)
        weight = plain_projection_weight(output.projection, "--training.objective kd", "use --training.objective sft")
        if isinstance(weight, DTensor):  # (vocabulary-sharded)
            weight = weight.full_tensor()
        return linear_distillation_sum(
            hidden.flatten(0, 1).index_select(0, fields.label_index),
            weight,
            fields.labels.flatten().index_select(0, fields.label_index),
            (fields.teacher_hidden, teacher_weight),
            alpha=self.cfg.alpha,
            temperature=self.cfg.temperature,
            beta=self.beta,
            chunk_size=self.cfg.chunk_size,
            softcap=getattr(output.projection, "logit_softcap", None),
            teacher_softcap=teacher_softcap,
        )

    def log_metrics(self) -> dict[str, float]:
        return self.inner.log_metrics()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
