"""The objective interface: what to optimize. The loop in titanium/trainer.py owns everything else.

An objective owns its data pipeline, its config section and any extra frozen models (a reference policy),
which it asks the loop for. Its microbatches are typed (titanium/batch.py): a core the loop owns
(tokens, positions, document ids) plus the objective's own fields, which say how many loss units the batch
holds (valid tokens for cross-entropy, pairs for DPO). Each step it may run a no-grad ``prepare`` phase over
the step's microbatches (reference log-probs, rollouts). For each microbatch it returns the *sum* of the
per-unit losses, plus metrics as (sum, count) pairs. The loop divides the loss by the global unit count of the
whole step, all-reduced once before the forward, so gradient accumulation, any data-parallel degree and padding
all give the exact mean gradient of the full batch; it reduces the metric sums and counts over the ranks the
same way.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import nn

from titanium.batch import Batch, Metrics, Placement
from titanium.config.registry import SectionSpec
from titanium.config.sections import ChatSection
from titanium.data.tokenizer import Tokenizer
from titanium.metrics.table import Table
from titanium.models.spec import ModelSpec

if TYPE_CHECKING:
    from titanium.model_builder import ModelSource

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
"""Label value that carries no loss (padding, prompt tokens)."""


@dataclass(frozen=True)
class JobFacts:
    """What an objective's pre-flight check (``Objective.check_config``) may know of the job besides its own
    sections, before any process group exists."""

    start: ModelSource
    """The policy as it starts: its family and shape (the Hugging Face start folder's, or the flavor's with the
    flavor's vocabulary: the tokenizer is not read yet)."""
    seq_len: int
    local_batch_size: int
    world_size: int
    """The job's processes."""
    pipeline_microbatch_size: int | None
    """Rows per pipeline microbatch; None without pipeline parallelism."""
    device_type: str
    """Where the job computes: cuda where torch sees a GPU, else cpu."""
    start_folder: str | None = None
    """The Hugging Face folder the policy's config.json comes from (an image-text model's processor lies beside it);
    None for a flavor."""


@dataclass
class ModelOutput:
    """What the loss sees of the forward pass.

    By default ``logits`` ``[B, S, vocab]`` (float32; a vocabulary-sharded DTensor under loss parallel).
    An objective with ``loss_input = "hidden"`` gets the final hidden states ``[B, S, dim]`` and the output
    projection module instead, to project chunk by chunk so the full logits never exist.
    """

    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    projection: nn.Module | None = None


@dataclass
class Prepared:
    """What ``prepare`` hands the loop: the step's microbatches, ready for the forward, and metrics of the
    step it measured on the way (as (sum, count); added once per step, e.g. rollout rewards)."""

    batches: list[Batch]
    metrics: Metrics = field(default_factory=dict)


@dataclass
class LossResult:
    loss_sum: torch.Tensor
    """Sum (not mean) of the per-unit losses of the microbatch."""
    metrics: Metrics = field(default_factory=dict)


class FrozenModel(Protocol):
    """A frozen model an objective holds (``ctx.models.frozen()``; titanium/model_handles.py): built when first
    run, by the same builder and parallel plan as the policy; freed once every owner released it."""

    id: str
    """What its outputs depend on (family, args, weights and their files, converters, precision), for an owner
    that caches them: a different id means stale outputs."""

    def __call__(self, batch: Batch) -> torch.Tensor | None:
        """Its logits ``[rows, seq, vocab]`` (float32, full vocabulary) for a microbatch as ``prepare`` gets it,
        without gradients; None on pipeline ranks without the last stage."""
        ...

    def release(self) -> None:
        """This owner is done with it."""
        ...


class PolicyModel(Protocol):
    """The live policy an objective may generate with, run forward-only, or follow (``ctx.models.policy()``)."""

    spec: Any
    """Its family (``titanium.models.spec.ModelSpec``)."""
    args: Any
    """Its model args (flavor)."""
    model: nn.Module
    """The live model (this rank's shards)."""
    pp_group: Any
    """The pipeline group when its stages are spread over ranks, else None."""
    tp_group: Any
    """The tensor-parallel group (its ranks hold the same rows), else None."""
    param_dtype: torch.dtype
    """The training forward's parameter precision."""

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Its logits (float32, full vocabulary) on model inputs without gradients, through its pipeline if it has
        one (None on ranks without the last stage); every rank of the layout calls it together."""
        ...

    def on_update(self, function: Any) -> None:
        """Call ``function(step)`` once the weights are in place and after every optimizer step."""
        ...

    def lend(self) -> contextlib.AbstractContextManager[nn.Module]:
        """The model being trained, sharded as it trains, in eval mode, without gradients, under the training
        forward's mixed precision. Under FSDP every forward is a collective: all data-parallel ranks generate
        together."""
        ...


class Models(Protocol):
    """The models of the job an objective may ask for, besides the one it trains (titanium/model_handles.py)."""

    def frozen(self, *, keep: Collection[str] = (), source: Any = None) -> FrozenModel:
        """A frozen model: ``source`` (a ``titanium.model_builder.ModelSource``; default: the policy as it started)
        with the policy's converters named in ``keep`` (default: none, e.g. a reference without LoRA)."""
        ...

    def policy(self) -> PolicyModel: ...

    def trainable(self, source: Any, *, name: str, lr: float, max_norm: float) -> Any:
        """Another model trained beside the policy (a ``titanium.model_handles.TrainableModel`` from ``source``, a
        ``ModelSource``), built by the same builder under the policy's parallel plan, its AdamW stepped, clipped,
        skipped and checkpointed by the loop with the policy's optimizer: a PPO value model."""
        ...


def _local(total: torch.Tensor) -> torch.Tensor:
    return total


def _units_here(batches: list[Batch]) -> torch.Tensor:
    return torch.stack([batch.units() for batch in batches]).sum()


@dataclass(frozen=True)
class ObjectiveContext:
    """What the loop hands an objective at construction: no config beyond the sections it needs."""

    tokenizer: Tokenizer
    model_name: str
    """Model family (registry key)."""
    chat_format: str
    """The chat format the family registers for its instruct models ("" if none): ``--chat.chat_template auto``'s
    choice when the tokenizer has no template of its own."""
    vocab_size: int
    seq_len: int
    local_batch_size: int
    dp_rank: int
    dp_world: int
    """This rank's data shard and the number of shards (under fault tolerance: over every replica group)."""
    seed: int
    loss_chunk_size: int = 0
    """``[training] loss_chunk_size``: tokens per chunk of a chunked cross-entropy (0: from full logits)."""
    models: Models | None = None
    """Frozen models (a reference, a teacher) and the live policy, each with a lifetime the objective controls."""
    device: torch.device = torch.device("cpu")
    """Where the models run (for work an objective does outside the step, e.g. a precompute pass)."""
    placement: Placement = field(default_factory=Placement)
    """Puts a CPU microbatch where the loop would (this rank's part of each sequence under context parallelism,
    on the device), and completes per-sequence sums from every rank's part (``add_parts``)."""
    chat: ChatSection = field(default_factory=ChatSection)
    """``[chat]``: how conversations become tokens, and the system prompt, for every objective that renders them."""
    dump_folder: str = "./outputs"
    """The job's output folder (job.dump_folder)."""
    fixed_shapes: bool = False
    """Every microbatch must be seq_len wide (pipeline parallelism: the schedule is built for one shape)."""
    sequence_multiple: int = 1
    """A microbatch narrower than seq_len must have a width this divides (the context- and tensor-parallel
    split of the sequence: 2 x cp and cp x tp; ``ParallelDims.sequence_multiple``)."""
    ranks_per_row: int = 1
    """The ranks that hold each data-parallel rank's rows (its tensor-, pipeline- and context-parallel ranks)."""
    sum_over_data: Callable[[torch.Tensor], torch.Tensor] = _local
    """A tensor of sums over this rank's rows, summed over every data-parallel rank's rows (each row counted once:
    the tensor-, pipeline- and context-parallel peers of a rank, which hold the same rows, are not added). Every rank
    calls it together. One process: the tensor itself."""
    step_units: Callable[[list[Batch]], torch.Tensor] = _units_here
    """The loop's divisor of a step's loss for these placed microbatches: their loss units added over the data- and
    context-parallel ranks, as the loop counts them before the forward (for a model an objective trains apart under
    the same loss rule). Every rank calls it together."""
    total_steps: int = 0
    """The optimizer steps the run trains for (training.steps; TRL's ``trainer_state.max_steps``)."""
    processor: Any = None
    """The model's processor, which objectives read rows beyond text through (``titanium.model_setup.job_processor``:
    an image-text model's ``titanium.data.vision.ImageData``, its processor and ``[vision]`` options); None for a
    text model."""


class Objective(ABC):
    section: ClassVar[SectionSpec | None] = None
    """An objective given by import path brings its config section here (``SectionSpec("name", Dataclass)``): the
    job config then has ``[name]`` and the constructor gets it. Built-in objectives register theirs with their name
    (titanium/config/components.py)."""
    more_sections: ClassVar[tuple[SectionSpec, ...]] = ()
    """Further sections an objective given by import path reads (an existing one such as ``SectionSpec("rollout",
    RolloutSection)``, or its own), each handed to the constructor by keyword under its name."""
    loss_input = "logits"
    """``"logits"`` (default) or ``"hidden"``: what ``ModelOutput`` carries into ``loss``."""
    loss_unit = "tokens"
    """What the loss is a mean over, in the plural, for logs (``validation/tokens``, ``validation/pairs``); with
    "tokens" the loss is taken for a token cross-entropy, and validation shows its perplexity."""
    loss_spikes = True
    """Whether a step's loss far above its running mean is worth a warning (``[guards] loss_spike_ratio``): False
    for a loss that sits near 0 with either sign (GRPO's advantage-weighted loss), whose ratio to its mean is
    noise."""
    metric_names: tuple[str, ...] = ()
    """The (sum, count) metrics ``loss`` may return, declared up front so every rank reduces the same list;
    they show on the console line and in TensorBoard/W&B."""
    trl_metric_names: Mapping[str, str] = {}
    """The names TRL's trainer for the same objective logs its metrics under (``dpo/margin`` -> ``rewards/margins``;
    a key ending in "/" names every metric under it, the value formatting the rest: ``rewards/{}/mean``): each is
    also logged under that name in TensorBoard / W&B, so dashboards built for TRL runs read titanium's."""

    @classmethod
    def policy_spec(cls, spec: ModelSpec, tokenizer: Tokenizer | None, hf_start: str | None) -> ModelSpec:
        """The spec the trained model is built (and exported) from, given the family's and the Hugging Face folder
        the run starts from (None: another start). The family's by default; a reward model's swaps the
        language-model head for a scalar one (titanium/objectives/reward.py). Called before the objective exists;
        ``tokenizer`` None before start-up (titanium.preflight builds the model on meta: its modules must not
        depend on the tokenizer)."""
        return spec

    @classmethod
    def frozen_sources(
        cls, section: Any, start: ModelSource, vocab_size: int | None, seq_len: int, **more: Any
    ) -> list[ModelSource]:
        """The frozen models an instance configured by ``section`` (its config section; its further sections by
        keyword, as the constructor gets them) will ask ``ctx.models`` for: ``start`` (the policy as it started) for
        a reference, another source for a teacher. Known without data, before the objective exists: the dry run adds
        their parameters to its memory estimate, the pre-flight check resolves them (``vocab_size`` None: the
        tokenizer's is not known yet, so vocabularies are not compared). None by default."""
        return []

    @classmethod
    def trainable_sources(
        cls, section: Any, start: ModelSource, vocab_size: int | None, seq_len: int, **more: Any
    ) -> list[ModelSource]:
        """The models an instance trains beside the policy with its own AdamW (``ctx.models.trainable``: PPO's
        value model), as ``frozen_sources``: the dry run adds their parameters, gradients and AdamW states to its
        memory estimate. None by default."""
        return []

    @classmethod
    def check_config(cls, section: Any, job: JobFacts, **more_sections: Any) -> None:
        """Raise ``ConfigError`` (a ``UserError``) for what an instance configured by ``section`` and its further
        sections (by name: GRPO's ``rl`` and ``rollout``) cannot run with, as far as the config decides it: run by
        ``titanium.preflight`` before any process group exists, so a mistake costs a second, not a start-up. By
        default: the models it would build from folders (``frozen_sources``, ``trainable_sources``) resolve (the
        folders exist and hold a model of the right family and shape). Beyond it, what needs data or the built
        model is checked when the objective is built."""
        cls.frozen_sources(section, job.start, None, job.seq_len, **more_sections)
        cls.trainable_sources(section, job.start, None, job.seq_len, **more_sections)

    @abstractmethod
    def next_microbatch(self) -> Batch:
        """The next microbatch for this data-parallel rank, as CPU tensors."""

    def skip_ahead(self, steps: int, step: int, microbatches_per_step: int) -> None:
        """Move this rank's data position ``steps`` optimizer steps forward, to where it would stand after ``step``
        steps had it never stopped: a replica group that heals from a live peer under fault tolerance (the peer's
        weights and step, this group's own data shard) reads none of its samples twice. By default: the
        microbatches of those steps are drawn and dropped."""
        for _ in range(steps * microbatches_per_step):
            self.next_microbatch()
        if steps:
            logger.info("skipped %d microbatches of this group's data shard to catch up", steps * microbatches_per_step)

    def prepare(self, microbatches: list[Batch]) -> Prepared:
        """No-grad work on the step's microbatches (on the device, after any context-parallel split) before
        the forward: e.g. fill reference log-probs into their fields. Runs once per step (a step retried under
        fault tolerance reuses it) and is timed apart from data loading."""
        return Prepared(microbatches)

    @abstractmethod
    def loss(self, output: ModelOutput, batch: Batch) -> LossResult:
        """The loss sum of `batch` and its metrics. Under pipeline parallelism `batch` is this pipeline
        microbatch's rows of the objective's microbatch, with every field it carries."""

    def check_layout(self, pipeline_microbatch_size: int | None) -> None:
        """Raise ``ConfigError`` for a parallel layout this objective cannot run under (None: no pipeline)."""
        return None

    def log_metrics(self) -> dict[str, float]:
        """Host-side numbers for the log line (e.g. skipped rows); no device sync."""
        return {}

    def tables(self, step: int) -> dict[str, Table]:
        """Tables of samples to log after optimizer step ``step``, by name (e.g. GRPO's completions with their
        rewards), on the steps the objective chooses: printed by rank 0 and sent to TensorBoard / W&B. Called after
        every step on the ranks that show them (rank 0, and those writing metrics); no collective. None by default."""
        return {}

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Data position and any other per-rank state to checkpoint."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None:  # noqa: B027 (most objectives hold nothing to free)
        """Free what the objective holds (a rollout engine), at the very end of the job: after the last checkpoint
        and export, and nothing collective may follow (vLLM's teardown destroys the default process group)."""


class LoaderObjective(Objective):
    """An objective that reads its microbatches from one loader (``self.loader``, with ``state_dict``) and counts
    the rows it read, skipped or cut in a ``DataMeter`` (``self.meter``): its checkpointed state is the loader's
    position and its log numbers the meter's."""

    loader: Any
    meter: Any

    def log_metrics(self) -> dict[str, float]:
        return self.meter.metrics()

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
