"""Image-text SFT against TRL 1.16 (issue 41, item 6): on the same three rows (one or two images each, of two
sizes), titanium's first SFT batch equals the batch of the collator ``SFTTrainer`` builds for a vision dataset
(``DataCollatorForVisionLanguageModeling``, taken from a constructed ``SFTTrainer``): token ids, label mask, pixel
values and every other image tensor the processor makes (Qwen-VL's ``image_grid_thw`` and ``mm_token_type_ids``,
which place its M-RoPE positions; Llama 3.2 Vision's aspect ratios and cross-attention mask, Gemma 3's
``token_type_ids``), exactly; and over 10 steps on those rows titanium's logged losses equal the losses
``SFTTrainer.train`` computes (``compute_loss``), with the optimizer settings made alike (AdamW, constant LR 1e-3,
beta2 0.999, no weight decay, gradients clipped to norm 1: TRL's defaults but the LR; fp32; 1e-5 relative, measured
within 3e-7).

TRL trains every token of a ``messages`` row, the image placeholders included; titanium by default learns only the
answers: conversations are compared under ``--sft.train_on_input --vision.image_token_loss``, TRL's setting.
Prompt/completion rows are compared at both defaults (the completion learned), for Gemma 3 and Qwen2.5-VL: for Llama
3.2 Vision TRL's prompt/completion batch is not a consistent one (its processor puts a BOS before the completion, and
the cross-attention mask stays as long as the prompt; docs/vision.md). The Qwen-VL processors (Qwen2.5-VL, Qwen3-VL)
need torchvision, which does not import beside torch 2.13 CPU: both trainers get the tiny one built without its video
processor (``tiny_processors.use_tiny_processors``: what ``AutoProcessor`` loads from the folder)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import scalars
from tests.objectives.tiny_processors import use_tiny_processors
from tests.objectives.tiny_vlm import assert_image_fields_equal, random_image, vlm_folder

pytest.importorskip("transformers")
pytest.importorskip("trl", reason="pip install 'trl>=1.16,<2' (in the dev extra) to compare with TRL")

STEPS, LR = 10, 1e-3
ROWS = [([28], "w5 w6", "w7 w8 w9"), ([56, 28], "w1", "w2 w3 w4 w5 w6"), ([28], "w3 w4 w10", "w11")]
"""(image widths, question, answer): every step's batch, in TRL's format (string contents, images placed by
``prepare_multimodal_messages``)."""


def write_rows(folder: Path, columns: str) -> list[dict]:
    """The rows (``columns``: "messages", or TRL's conversational "prompt/completion") as a jsonl file with PNG
    images beside it (titanium's input), and as TRL's rows with the same images decoded."""
    from PIL import Image

    ours, theirs = [], []
    for i, (widths, question, answer) in enumerate(ROWS):
        names = []
        for k, width in enumerate(widths):
            names.append(f"image{i}_{k}.png")
            random_image(10 * i + k, width, 28).save(folder / names[-1])
        user, assistant = [{"role": "user", "content": question}], [{"role": "assistant", "content": answer}]
        row = {"messages": user + assistant} if columns == "messages" else {"prompt": user, "completion": assistant}
        ours.append({**row, "images": names})
        theirs.append({**row, "images": [Image.open(folder / n).convert("RGB") for n in names]})
    (folder / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ours))
    return theirs


def trl_settings(output: Path, rows: list[dict], steps: int, lr: float) -> dict:
    """The TRL config fields every comparison sets: all rows a step, CPU, fp32, ``steps`` steps at a constant ``lr``,
    no saves or reports."""
    return dict(
        output_dir=str(output),
        per_device_train_batch_size=len(rows),
        report_to=[],
        use_cpu=True,
        bf16=False,
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="constant",
        save_strategy="no",
    )


def trl_trainer(folder: Path, rows: list[dict], output: Path):
    """``SFTTrainer`` on the Hugging Face folder as TRL configures it for a vision dataset (its processor loaded by
    TRL from the model's folder with ``AutoProcessor``; the collator, masks and loss TRL's defaults), every step on
    all the rows."""
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText
    from trl import SFTConfig, SFTTrainer

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    args = SFTConfig(**trl_settings(output, rows, STEPS, LR))
    return SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows))


@pytest.mark.parametrize(
    ("model_type", "columns"),
    [
        ("mllama", "messages"),
        ("gemma3", "messages"),
        ("gemma3", "prompt/completion"),
        ("qwen2_5_vl", "messages"),
        ("qwen2_5_vl", "prompt/completion"),
        ("qwen3_vl", "messages"),
    ],
)
def test_sft_batch_and_losses_equal_trl(
    model_type: str, columns: str, make_trainer, monkeypatch, tmp_path: Path
) -> None:
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    use_tiny_processors(monkeypatch)
    folder = vlm_folder(model_type, tmp_path / "model", seed=2)
    rows = write_rows(tmp_path, columns)
    trl = trl_trainer(folder, rows, tmp_path / "trl")
    assert isinstance(trl.data_collator, DataCollatorForVisionLanguageModeling)
    theirs = trl.data_collator([dict(row) for row in trl.train_dataset])
    trl_losses = []
    compute_loss = trl.compute_loss
    trl.compute_loss = lambda *args, **kwargs: record(trl_losses, compute_loss(*args, **kwargs))
    trl.train()

    run = tmp_path / "run"
    args = ["--job.dump_folder", str(run), "--job.no_print_config", "--metrics.log_freq", "1", "--checkpoint.no_enable"]
    args += ["--training.seq_len", "64", "--training.mixed_precision_param", "float32"]
    args += ["--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf"]
    args += ["--data.path", str(tmp_path / "rows.jsonl"), "--data.kind", "chat", "--training.objective", "sft"]
    args += ["--sft.no_packing", "--training.local_batch_size", str(len(ROWS)), "--training.steps", str(STEPS)]
    args += ["--optimizer.lr", str(LR), "--optimizer.beta2", "0.999", "--optimizer.weight_decay", "0"]
    args += ["--lr_scheduler.warmup_steps", "0", "--lr_scheduler.min_lr_factor", "1", "--training.max_norm", "1"]
    if columns == "messages":  # (TRL learns every token of a conversation; of prompt/completion rows the completion)
        args += ["--sft.train_on_input", "--vision.image_token_loss"]
    trainer = make_trainer(*args)
    ours = trainer._new_objective(trainer.cfg.data).next_microbatch()  # (a fresh copy of the first batch)

    real = theirs["attention_mask"].bool()  # (titanium pads wider: to a multiple of 8, --sft.pad_multiple)
    width = real.shape[1]
    assert ours.rows == real.shape[0] and ours.tokens.shape[1] >= width
    assert torch.equal(ours.tokens[:, :width][real], theirs["input_ids"][real])
    labels = ours.fields.labels  # (shifted in the data: position t holds the label of token t + 1)
    assert torch.equal(labels[:, : width - 1], theirs["labels"][:, 1:]) and (labels[:, width - 1 :] == -100).all()

    layout = trainer.objective.samples.images.layout
    assert_image_fields_equal(ours.images, theirs, layout, real, width, {"input_ids", "attention_mask", "labels"})

    trainer.train()
    losses = scalars(run / "tb")
    ours_losses = [losses[step] for step in range(1, STEPS + 1)]
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours_losses, trl_losses))
    print(f"{model_type} {columns}: titanium {ours_losses} TRL {trl_losses} largest relative difference {worst:.2g}")
    assert ours_losses == pytest.approx(trl_losses, rel=1e-5), (ours_losses, trl_losses)


def record(losses: list[float], loss: torch.Tensor) -> torch.Tensor:
    losses.append(loss.item())
    return loss
