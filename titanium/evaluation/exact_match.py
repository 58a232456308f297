"""Exact-match evaluation: greedy (or sampled) answers to held-out chat prompts, compared with the references.

A cheap, honest signal that fine-tuning taught the task (loss can fall while answers stay wrong). It
runs inside training on every data-parallel rank, so it follows one rule for FSDP: every model forward
is a collective, hence every rank runs the same number of batches (short shares are padded with a
dummy prompt) and generation stops early only when all ranks agree that all their rows are done.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titanium.batch import ImageInputs
from titanium.config.sections import DataSection, EvalSection
from titanium.data.chat import ChatTemplate, RowError, build_chat_template, parse_chat_row, with_system_prompt
from titanium.data.lines import BadLine
from titanium.data.sft import ROW_FIX
from titanium.data.text import BROKEN_LINE_FIX, DataError, Source, bad_row_error, resolve_sources, stream_rows
from titanium.data.tokenizer import Tokenizer, decode_sampled
from titanium.data.vision import ImageData, image_rows, images_of
from titanium.data.vision_sft import image_prompt
from titanium.evaluation.periodic import EvaluationContext
from titanium.generation.generate import all_ranks_done, check_room, generate
from titanium.generation.sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalSample:
    prompt: list[int]
    """The conversation before the last message, plus the assistant header."""
    reference: str
    """The last (assistant) message: the answer to match."""
    images: dict[str, torch.Tensor] | None = None
    """The prompt's image fields, as the model's processor made them (an image-text model's rows); None: text."""


def read_rows(path: str, limit: int) -> list[tuple[Source, int, Any]]:
    """(source, row, item) of the first ``limit`` rows of ``path`` (files or a hub dataset, as ``--data.path``).

    An item is a BadLine where a line of a local file could not be read as a row.
    """
    rows: list[tuple[Source, int, Any]] = []
    for source in resolve_sources(DataSection(path=path), flag="--eval.path"):
        for row, item in stream_rows(source, 0):
            if len(rows) == limit:
                return rows
            rows.append((source, row, item))
    return rows


def _eval_sample(item: Any, data: DataSection, template: ChatTemplate, system_prompt: str | None) -> EvalSample:
    """The row's prompt, with the system prompt applied as SFT samples get it, and its reference answer."""
    if isinstance(item, BadLine):
        raise RowError(item.problem)
    messages = parse_chat_row(item, data)
    if len(messages) < 2:
        raise RowError("a single assistant message leaves no prompt to answer")
    messages = with_system_prompt(messages, system_prompt)
    return EvalSample(template.prompt(messages[:-1]), messages[-1].content)


def load_eval_samples(
    cfg: EvalSection,
    data: DataSection,
    template: ChatTemplate,
    tokenizer: Tokenizer,
    system_prompt: str | None = None,
    processor: ImageData | None = None,
) -> list[EvalSample]:
    """Prompts and references of the first ``cfg.max_samples`` rows (columns named as in [data] kind=chat); with
    an image-text model's ``processor``, rows with images read as its SFT data reads them.

    A malformed row is skipped with a warning, or is an error with ``--data.on_bad_row fail``.
    """
    samples, bad = [], 0
    for source, row, item in read_rows(cfg.path, cfg.max_samples):
        try:
            if processor is not None:
                if isinstance(item, BadLine):
                    raise RowError(item.problem)
                ids, fields, answer = image_prompt(item, source, data, processor, system_prompt)
                samples.append(EvalSample(ids, answer, fields))
            else:
                samples.append(_eval_sample(item, data, template, system_prompt))
        except RowError as e:
            if data.on_bad_row == "fail":
                fix = BROKEN_LINE_FIX if isinstance(item, BadLine) else ROW_FIX["chat"]
                raise bad_row_error(source, row, str(e), fix) from None
            bad += 1
    if bad:
        logger.warning("eval: skipped %d malformed rows of %s", bad, cfg.path)
    if not samples:
        raise DataError(f"--eval.path {cfg.path}: no usable chat rows (columns: --data.messages_column etc.)")
    return samples


class ExactMatchEvaluator:
    """``evaluator(model)`` -> ``{"eval/exact_match": fraction, "eval/samples": n}`` over all DP ranks.

    Row i of the held-out set belongs to data-parallel rank ``i % dp_world``. ``group`` is the
    data-parallel process group (None: the default group); it is used only when ``dp_world > 1``.
    Ranks that share a ``dp_rank`` (tensor or context parallel peers) generate the same tokens, so
    they agree on when to stop without talking. Pipeline-parallel stages cannot generate alone.
    """

    def __init__(
        self,
        cfg: EvalSection,
        data: DataSection,
        template: ChatTemplate,
        tokenizer: Tokenizer,
        dp_rank: int = 0,
        dp_world: int = 1,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        system_prompt: str | None = None,
        processor: ImageData | None = None,
    ) -> None:
        self.cfg, self.device, self.group, self.dp_world = cfg, torch.device(device), group, dp_world
        self.stop_ids, self.pad_id, self.tokenizer = set(template.stop_ids), tokenizer.pad_id, tokenizer
        self.layout = processor.layout if processor is not None else None
        samples = load_eval_samples(cfg, data, template, tokenizer, system_prompt, processor)
        self.total = len(samples)
        self.longest_prompt = max(len(s.prompt) for s in samples)
        self.mine = samples[dp_rank::dp_world]
        # Every rank runs the same number of batches: pad short shares with a dummy (never scored) prompt.
        per_rank = math.ceil(self.total / dp_world)
        prompts = self.mine + [samples[0]] * (per_rank - len(self.mine))
        self.answers_per_prompt = cfg.samples_per_prompt if cfg.temperature > 0 else 1
        self.prompts = [p for p in prompts for _ in range(self.answers_per_prompt)]
        self.params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
        self.seed = dp_rank  # (tensor/context-parallel peers share a dp_rank: they draw alike)
        self.all_done = all_ranks_done(group, self.device) if dp_world > 1 else None

    def __call__(self, model: nn.Module) -> dict[str, float]:
        """Greedy (or sampled) answers for this rank's share, scored ``decoded.strip() == reference.strip()``.
        Sampling starts from the same seed at every call, so evaluations along a run draw alike."""
        check_room(model, self.longest_prompt, self.cfg.max_new_tokens)  # on every rank alike, before any forward
        was_training = model.training
        model.eval()
        try:
            answers: list[list[int]] = []
            size = self.cfg.batch_size if self.layout is None else 1  # (a prompt's image fields are not padded)
            generator = torch.Generator(self.device).manual_seed(self.seed)
            for start in range(0, len(self.prompts), size):
                batch = self.prompts[start : start + size]
                generation = generate(
                    model,
                    [sample.prompt for sample in batch],
                    self.params,
                    self.stop_ids,
                    self.pad_id,
                    generator=generator,
                    device=self.device,
                    all_done=self.all_done,
                    images=self._images(batch[0]),
                )
                answers += generation.token_lists()
        finally:
            model.train(was_training)
        k = self.answers_per_prompt
        references = [s.reference.strip() for s in self.mine for _ in range(k)]
        correct = sum(decode_sampled(self.tokenizer, ids).strip() == ref for ids, ref in zip(answers, references))
        counts = torch.tensor([correct, len(references)], dtype=torch.float64, device=self.device)
        if self.dp_world > 1:
            dist.all_reduce(counts, group=self.group)
        correct_all, n = counts.tolist()
        return {"eval/exact_match": correct_all / n, "eval/samples": n / k}

    def _images(self, sample: EvalSample) -> ImageInputs | None:
        """A prompt's images as the model reads them (a batch of that one prompt); None for a text prompt."""
        if self.layout is None or sample.images is None:
            return None
        return images_of(image_rows([{"images": sample.images}], len(sample.prompt), self.layout))


class ExactMatchEvaluation:
    """``[eval]`` as the loop runs it: before the first step, every ``interval`` steps and after the last, on the
    live policy."""

    at_start = True

    def __init__(self, evaluator: ExactMatchEvaluator, interval: int, policy: Any) -> None:
        self.evaluator, self.interval, self.policy = evaluator, interval, policy

    def due(self, step: int, last_step: int) -> bool:
        return step % self.interval == 0 or step == last_step

    def run(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        scalars = self.evaluator(self.policy.model)
        logger.info(
            "eval step %d: exact match %.1f%% of %d held-out samples (%.1fs)",
            step,
            100 * scalars["eval/exact_match"],
            scalars["eval/samples"],
            time.perf_counter() - start,
        )
        return scalars


def build_evaluator(cfg: EvalSection, ctx: EvaluationContext) -> ExactMatchEvaluation | None:
    """Held-out exact match of greedy answers (``interval`` > 0), on every data-parallel rank."""
    if cfg.interval == 0:
        return None
    template = build_chat_template(ctx.chat.chat_template, ctx.tokenizer, ctx.chat_format)
    evaluator = ExactMatchEvaluator(
        cfg,
        ctx.data,
        template,
        ctx.tokenizer,
        dp_rank=ctx.dp_rank,
        dp_world=ctx.dp_world,
        group=ctx.dp_group,
        device=ctx.device,
        system_prompt=ctx.chat.system_prompt,
        processor=ctx.processor,
    )
    return ExactMatchEvaluation(evaluator, cfg.interval, ctx.policy)
