"""Distillation between image-text models (issue 41, item 5): a tiny Gemma 3 student from a wider tiny Gemma 3
teacher (the same processor and tokenizer) on conversations with images; titanium's step-1 KD loss equals the loss
computed from ``transformers``' forwards of both models on the same rows (processed as one right-padded batch),
``(1 - alpha) * CE + alpha * T^2 * KL(teacher || student)`` per answer token written out here (fp32, 1e-5 relative);
the teacher reads the rows' pixel values (another picture moves the loss). Teachers that cannot read the student's
inputs are refused before start-up: a text-only teacher, another processor (another image size, another
architecture's); exit 2, one message, no traceback."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, env, scalars
from tests.objectives.tiny_vlm import random_image, vlm_folder

pytest.importorskip("transformers")

ROWS = [([28], "w5 w6", "w7 w8 w9"), ([56, 28], "w1", "w2 w3 w4 w5 w6"), ([28], "w3 w4 w10", "w11")]
"""(image widths, question, answer): the first step's batch."""
ALPHA, TEMPERATURE = 0.5, 2.0
TEACHER = dict(hidden_size=48, intermediate_size=96)
"""The teacher's language model: wider than the student's (32)."""


def write_rows(folder: Path, name: str = "rows.jsonl", swap: bool = False) -> list[tuple[list, str, str]]:
    """The rows as a jsonl file with PNG images beside it; returns each row's (images, question, answer). ``swap``:
    row 0 shows row 2's picture (of the same size)."""
    rows, ours = [], []
    for i, (widths, question, answer) in enumerate(ROWS):
        names = [f"image{i}_{k}.png" for k in range(len(widths))]
        pictures = [random_image(10 * i + k, width, 28) for k, width in enumerate(widths)]
        for file, picture in zip(names, pictures):
            picture.save(folder / file)
        user = {"role": "user", "content": [{"type": "image"}] * len(widths) + [{"type": "text", "text": question}]}
        ours.append({"messages": [user, {"role": "assistant", "content": answer}], "images": names})
        rows.append((pictures, question, answer))
    if swap:
        ours[0]["images"] = ours[2]["images"]
    (folder / name).write_text("".join(json.dumps(row) + "\n" for row in ours))
    return rows


def reference_kd_loss(student: Path, teacher: Path, rows: list) -> float:
    """The KD loss over the answers' tokens (their end-of-turn tokens included, as titanium's chat cuts learn them),
    from ``transformers``' forwards of both models on the rows as one right-padded batch."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(student)
    kwargs = dict(return_tensors="pt", add_special_tokens=False)
    texts, starts = [], []
    for pictures, question, answer in rows:
        user = [{"role": "user", "content": [{"type": "image"}] * len(pictures) + [{"type": "text", "text": question}]}]
        head = processor.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        texts.append(processor.apply_chat_template([*user, {"role": "assistant", "content": answer}], tokenize=False))
        starts.append(processor(text=[head], images=[pictures], **kwargs)["input_ids"].shape[1])
    batch = processor(text=texts, images=[row[0] for row in rows], padding=True, padding_side="right", **kwargs)
    with torch.no_grad():
        logits = [
            AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)(**batch).logits.float()
            for folder in (student, teacher)
        ]
    ids, real = batch["input_ids"], batch["attention_mask"].bool()
    learned = (torch.arange(ids.shape[1] - 1)[None, :] >= torch.tensor(starts)[:, None] - 1) & real[:, 1:]
    student_logits, teacher_logits = (x[:, :-1][learned] for x in logits)
    labels = ids[:, 1:][learned]
    cross_entropy = torch.nn.functional.cross_entropy(student_logits, labels, reduction="none")
    teacher_logp = torch.log_softmax(teacher_logits / TEMPERATURE, -1)
    student_logp = torch.log_softmax(student_logits / TEMPERATURE, -1)
    divergence = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)
    return ((1 - ALPHA) * cross_entropy + ALPHA * TEMPERATURE**2 * divergence).mean().item()


def kd_args(student: Path, teacher: Path, data: Path, run: Path) -> list[str]:
    args = ["--job.dump_folder", str(run), "--job.no_print_config", "--metrics.log_freq", "1", "--checkpoint.no_enable"]
    args += ["--training.seq_len", "64", "--training.mixed_precision_param", "float32"]
    args += ["--checkpoint.initial_load_path", str(student), "--checkpoint.initial_load_in_hf"]
    args += ["--data.path", str(data), "--data.kind", "chat", "--training.objective", "kd"]
    args += ["--kd.teacher_path", str(teacher), "--kd.no_packing", "--kd.alpha", str(ALPHA)]
    return args + ["--kd.temperature", str(TEMPERATURE), "--training.local_batch_size", str(len(ROWS))]


def first_loss(make_trainer, args: list[str], run: Path) -> float:
    from titanium.parallel.distributed import shutdown_distributed

    trainer = make_trainer(*args, "--training.steps", "1")
    trainer.train()
    trainer.metrics.close()  # (flushes every scalar of the step)
    shutdown_distributed()  # (the next run in this process starts its own group)
    return scalars(run / "tb")[1]


def test_kd_loss_equals_transformers_forwards_of_both_models(make_trainer, tmp_path: Path) -> None:
    student = vlm_folder("gemma3", tmp_path / "student", seed=2)
    teacher = vlm_folder("gemma3", tmp_path / "teacher", seed=3, **TEACHER)
    rows = write_rows(tmp_path)
    write_rows(tmp_path, "swapped.jsonl", swap=True)
    expected = reference_kd_loss(student, teacher, rows)

    loss = first_loss(
        make_trainer, kd_args(student, teacher, tmp_path / "rows.jsonl", tmp_path / "run"), tmp_path / "run"
    )
    print(f"gemma3 KD: titanium {loss:.8f} transformers {expected:.8f}")  # (the docs)
    assert loss == pytest.approx(expected, rel=1e-5)
    run = tmp_path / "swapped"
    moved = first_loss(make_trainer, kd_args(student, teacher, tmp_path / "swapped.jsonl", run), run)
    assert abs(moved - loss) > 1e-4 * loss  # (both models read the pictures)


def text_teacher(folder: Path) -> Path:
    """A Hugging Face folder of a tiny text-only Llama with the student's vocabulary size."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def other_size_teacher(folder: Path) -> Path:
    """The student's architecture with a processor that makes 56-pixel images (other pixel values)."""
    from transformers import AutoProcessor

    vlm_folder("gemma3", folder, seed=3)
    processor = AutoProcessor.from_pretrained(folder)
    processor.image_processor.size = {"height": 56, "width": 56}
    processor.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("teacher", "message"),
    [
        (text_teacher, "this teacher reads no images (a text-only model)"),
        (other_size_teacher, "they differ in image_processor"),
        (lambda folder: vlm_folder("mllama", folder), "its processor (MllamaProcessor) would make other model inputs"),
    ],
    ids=["text-only", "other-image-size", "other-architecture"],
)
def test_teachers_that_cannot_read_the_students_inputs_are_refused_before_start_up(teacher, message, tmp_path):
    from titanium.config.loader import ConfigError
    from titanium.inputs import load_job
    from titanium.preflight import check_job

    student = vlm_folder("gemma3", tmp_path / "student", seed=2)
    folder = teacher(tmp_path / "teacher")
    write_rows(tmp_path)
    args = kd_args(student, folder, tmp_path / "rows.jsonl", tmp_path / "run")
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        check_job(load_job(args), 1)
    assert f"--kd.teacher_path {folder}" in str(error.value)


def test_a_text_only_teacher_exits_2_without_a_traceback(tmp_path: Path) -> None:
    student = vlm_folder("gemma3", tmp_path / "student", seed=2)
    write_rows(tmp_path)
    args = kd_args(student, text_teacher(tmp_path / "teacher"), tmp_path / "rows.jsonl", tmp_path / "run")
    result = subprocess.run(
        [sys.executable, "-m", "titanium.train", *args],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "this teacher reads no images" in result.stderr and "Traceback" not in result.stderr
