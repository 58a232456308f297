"""Supervised fine-tuning: masked next-token cross-entropy on chat, instruct or text-completion samples.

Labels are shifted inside each sample by the data pipeline (prompt tokens and each sample's last
position carry IGNORE_INDEX), so a packed row needs no slicing and no loss leaks across samples.
Packed rows also carry per-sample positions and document ids: attention stays within a sample, so a
sample's loss is the same packed or alone. The loss is a sum over trainable tokens; the loop divides
by the global count, which makes every layout and accumulation give the exact token mean.
"""

from __future__ import annotations

from functools import partial

from titanium.batch import Batch
from titanium.config.sections import DataSection, SFTSection
from titanium.data.chat import build_optional_chat_template
from titanium.data.loader import BatchLoader
from titanium.data.meter import DataMeter
from titanium.data.packing import PackedDataset, make_row, padded_rows, row_width
from titanium.data.sft import SFTDataset
from titanium.data.vision import collate_image_rows, packed_image_row, padded_image_rows
from titanium.data.vision_sft import VisionSFTDataset
from titanium.objectives.base import LoaderObjective, LossResult, ModelOutput, ObjectiveContext, Prepared
from titanium.objectives.losses.cross_entropy import TokenCrossEntropy, token_batch


class SFTObjective(LoaderObjective):
    def __init__(self, ctx: ObjectiveContext, data: DataSection, sft: SFTSection) -> None:
        chat = ctx.chat
        pad_id, pin = ctx.tokenizer.pad_id, ctx.device.type == "cuda"
        if ctx.processor is not None:  # an image-text model: rows with images through its processor
            self.samples = VisionSFTDataset(
                data, sft, ctx.processor, ctx.seq_len, ctx.dp_rank, ctx.dp_world, chat.system_prompt
            )
        else:
            template = build_optional_chat_template(chat.chat_template, ctx.tokenizer, ctx.chat_format)
            self.samples = SFTDataset(
                data, sft, ctx.tokenizer, template, ctx.seq_len, ctx.dp_rank, ctx.dp_world, chat.system_prompt
            )
        if sft.packing:  # each sample's images travel with it (preflight refuses the models that cannot pack them)
            row_of, collate = make_row, None
            if ctx.processor is not None:
                row_of = partial(packed_image_row, layout=ctx.processor.layout)
                collate = partial(collate_image_rows, layout=ctx.processor.layout)
            rows = PackedDataset(self.samples, ctx.seq_len, pad_id, sft.pack_buffer, row_of)
            self.loader = BatchLoader(
                rows, ctx.local_batch_size, data.prefetch_batches, pin_memory=pin, collate_fn=collate
            )
        else:  # one sample per row, padded together (to the microbatch's longest by default)
            pad_to, multiple = row_width(
                sft.pad_to, sft.pad_multiple, ctx.fixed_shapes, ctx.sequence_multiple, "--sft.pad_to"
            )
            pad = partial(padded_rows, seq_len=ctx.seq_len, pad_id=pad_id, pad_to=pad_to, pad_multiple=multiple)
            if ctx.processor is not None:
                pad = partial(padded_image_rows, pad, layout=ctx.processor.layout)
            self.loader = BatchLoader(
                self.samples, ctx.local_batch_size, data.prefetch_batches, pin_memory=pin, collate_fn=pad
            )
        self.meter = DataMeter(self.samples)
        self.cross_entropy = TokenCrossEntropy(ctx.loss_chunk_size)
        self.loss_input = self.cross_entropy.loss_input

    def next_microbatch(self) -> Batch:
        rows = next(self.loader)
        self.meter.add(rows)
        return token_batch(rows)

    def prepare(self, microbatches: list[Batch]) -> Prepared:
        return Prepared(self.cross_entropy.prepare(microbatches))

    def loss(self, output: ModelOutput, batch: Batch) -> LossResult:
        return LossResult(self.cross_entropy(output, batch))
