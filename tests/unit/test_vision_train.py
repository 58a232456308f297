"""The whole loop on an image-text model: ``titanium.train``'s SFT (one process) from a tiny Gemma 3 folder with
images on disk logs, at its first step, the loss ``transformers`` gives on the same rows (the processor's tokens and
pixels, the assistant's tokens learned; fp32, 1e-5 relative). Other images move that loss by 3e-3 relative: the
images reach the model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import scalars
from tests.objectives.tiny_vlm import random_image, tiny_vlm, vlm_folder

pytest.importorskip("transformers")

CONVERSATIONS = [("w5 w6", "w7 w8 w9", 28), ("w1", "w2 w3 w4 w5", 56)]
"""(question, answer, image width) of the two rows: one step's batch."""


def messages(question: str, answer: str | None = None) -> list[dict]:
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
    return [user] if answer is None else [user, {"role": "assistant", "content": answer}]


def reference_loss(folder: Path, images: list) -> float:
    """Mean cross-entropy of ``transformers``' Gemma 3 over the answers' tokens (after the generation prompt)."""
    from transformers import AutoProcessor

    processor, model = AutoProcessor.from_pretrained(str(folder)), tiny_vlm("gemma3", seed=1)
    total, count = 0.0, 0
    for (question, answer, _), image in zip(CONVERSATIONS, images, strict=True):
        prompt = processor.apply_chat_template(messages(question), add_generation_prompt=True, tokenize=False)
        full = processor.apply_chat_template(messages(question, answer), tokenize=False)
        inputs = processor(text=[full], images=[[image]], return_tensors="pt", add_special_tokens=False)
        start = processor(text=[prompt], images=[[image]], return_tensors="pt", add_special_tokens=False)
        start = start["input_ids"].shape[1]
        with torch.no_grad():
            logits = model(**inputs).logits[0]
        ids = inputs["input_ids"][0]
        losses = torch.nn.functional.cross_entropy(logits[start - 1 : -1], ids[start:], reduction="none")
        total, count = total + losses.sum().item(), count + losses.numel()
    return total / count


def sft_job(tmp_path: Path, bad_row: bool = False) -> tuple[Path, list[Any], list[str]]:
    """The tiny Gemma 3 folder, the ``CONVERSATIONS`` images, and the arguments of an SFT run on their rows (with
    ``bad_row``, one whose image is missing between the first two)."""
    folder = vlm_folder("gemma3", tmp_path / "model", seed=1)
    images, rows = [], []
    for i, (question, answer, width) in enumerate(CONVERSATIONS):
        images.append(random_image(i, width, 28))
        images[-1].save(tmp_path / f"image{i}.png")
        rows.append({"messages": messages(question, answer), "images": [f"image{i}.png"]})
    if bad_row:
        rows.insert(1, {"messages": messages("w3", "w4"), "images": ["missing.png"]})
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["--job.dump_folder", str(tmp_path / "run"), "--job.no_print_config", "--metrics.log_freq", "1"]
    args += ["--checkpoint.no_enable", "--training.mixed_precision_param", "float32"]
    args += ["--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf"]
    args += ["--data.path", str(tmp_path / "rows.jsonl"), "--data.kind", "chat", "--training.objective", "sft"]
    return folder, images, args


def test_sft_on_images_logs_transformers_loss(make_trainer, tmp_path: Path) -> None:
    folder, images, args = sft_job(tmp_path)
    run = tmp_path / "run"
    args += ["--training.seq_len", "64", "--sft.no_packing", "--training.local_batch_size", "2"]
    args += ["--training.steps", "2"]
    trainer = make_trainer(*args)
    trainer.train()
    losses = scalars(run / "tb")
    assert sorted(losses) == [1, 2]
    assert losses[1] == pytest.approx(reference_loss(folder, images), rel=1e-5)


def test_packed_sft_on_images_skips_a_bad_row_and_logs_transformers_loss(make_trainer, tmp_path: Path) -> None:
    """``--sft.packing``: the two rows packed into one row with their images, a row whose image is missing between
    them skipped and counted; the first step logs the loss ``transformers`` gives on the two rows one by one."""
    folder, images, args = sft_job(tmp_path, bad_row=True)
    run = tmp_path / "run"
    args += ["--training.seq_len", "40", "--data.prefetch_batches", "0"]
    args += ["--sft.packing", "--sft.pack_buffer", "1", "--training.local_batch_size", "1", "--training.steps", "1"]
    make_trainer(*args).train()
    assert scalars(run / "tb")[1] == pytest.approx(reference_loss(folder, images), rel=1e-5)
    assert scalars(run / "tb", "data/skipped_rows") == {1: 1.0}


def test_other_objectives_are_refused_for_an_image_text_model(make_trainer, tmp_path: Path) -> None:
    """A reward model (and every objective whose rows do not carry images: pretraining, PPO) would read the
    rows' text and drop their images: refused, naming the flag and the objectives that read images."""
    from titanium.config.errors import ConfigError

    folder = vlm_folder("gemma3", tmp_path / "model", seed=1)
    row = {"prompt": "w1", "chosen": "w2", "rejected": "w3"}
    (tmp_path / "pairs.jsonl").write_text(json.dumps(row) + "\n")
    args = ["--job.dump_folder", str(tmp_path / "run"), "--checkpoint.initial_load_path", str(folder)]
    args += ["--checkpoint.initial_load_in_hf", "--data.path", str(tmp_path / "pairs.jsonl")]
    args += ["--data.kind", "preference", "--training.objective", "reward", "--training.seq_len", "64"]
    with pytest.raises(
        ConfigError,
        match="--training.objective reward: an image-text model trains on images with sft, dpo, grpo, online_dpo, kd,",
    ):
        make_trainer(*args)
