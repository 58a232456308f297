"""Image-text KTO beyond the comparison with TRL (tests/unit/test_vision_kto_trl.py, Gemma 3): for Llama 3.2 Vision,
whose cross-attention mask TRL's batch does not make consistently, titanium's step-1 KTO loss equals the loss computed
from ``transformers``' forwards of the policy and the reference on the rows processed whole by the model's processor,
as one right-padded batch (the examples; and the mismatched rows: each example's prompt and images with the previous
example's completion), with KTO's formula written out here (fp32, 1e-5 relative; the KL estimate positive, so the
mismatched rows count). One batch, not each row alone: in ``transformers``' Llama 3.2 Vision the tokens before a
row's first image attend to every image slot of the batch (their fully masked cross-attention rows are unmasked and
only the MLP's part is zeroed), so a row's numbers depend on the batch's largest image count; titanium's batch is
``transformers``' (tests/unit/test_vision_trl.py). Bad rows are skipped and counted; a long example keeps its whole
prompt (its image tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import scalars
from tests.objectives.tiny_vlm import random_image, vlm_folder, with_reference

pytest.importorskip("transformers")

ROWS = [
    ([28], "w5 w6", "w7 w8", True),
    ([56, 28], "w1", "w2 w3 w4", False),
    ([28], "w3 w4 w10", "w11", False),
    ([56], "w12", "w6 w9 w13 w14", True),
]
"""(image widths, question, completion, label): the first step's batch."""
BETA = 0.1


def unpaired(question: str, completion: str, label: object, images: list[str]) -> dict:
    return {
        "prompt": [{"role": "user", "content": question}],
        "completion": [{"role": "assistant", "content": completion}],
        "label": label,
        "images": images,
    }


def write_rows(folder: Path) -> list[tuple[list, str, str, bool]]:
    """The rows as a jsonl file with PNG images beside it; returns each row's (images, question, completion, label)."""
    rows, ours = [], []
    for i, (widths, question, completion, label) in enumerate(ROWS):
        names = [f"image{i}_{k}.png" for k in range(len(widths))]
        pictures = [random_image(10 * i + k, width, 28) for k, width in enumerate(widths)]
        for name, picture in zip(names, pictures):
            picture.save(folder / name)
        ours.append(unpaired(question, completion, label, names))
        rows.append((pictures, question, completion, label))
    (folder / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ours))
    return rows


def completion_logps(model, processor, prompts: list[str], completions: list[str], pictures: list) -> torch.Tensor:
    """Each row's summed log-prob of its completion's tokens after its prompt (texts as the chat template writes
    them) [rows]: the rows' whole texts and images processed as one batch, right-padded."""
    kwargs = dict(return_tensors="pt", add_special_tokens=False)
    texts = [prompt + completion for prompt, completion in zip(prompts, completions)]
    whole = processor(text=texts, images=pictures, padding=True, padding_side="right", **kwargs)
    starts = [processor(text=[p], images=[i], **kwargs)["input_ids"].shape[1] for p, i in zip(prompts, pictures)]
    with torch.no_grad():
        logits = model(**whole).logits.float()
    ids, real = whole["input_ids"], whole["attention_mask"].bool()
    logps = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    completion = (torch.arange(ids.shape[1] - 1)[None, :] >= torch.tensor(starts)[:, None] - 1) & real[:, 1:]
    return torch.where(completion, logps, 0.0).sum(-1)


def reference_kto_loss(policy: Path, reference: Path, rows: list) -> tuple[float, float]:
    """KTO's loss (TRL's default: beta 0.1, weights 1) and its KL estimate, from ``transformers``' forwards."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(policy)
    models = [AutoModelForImageTextToText.from_pretrained(f, dtype=torch.float32).eval() for f in (policy, reference)]
    heads, completions = [], []
    for pictures, question, completion, _ in rows:
        user = [{"role": "user", "content": [{"type": "image"}] * len(pictures) + [{"type": "text", "text": question}]}]
        heads.append(processor.apply_chat_template(user, tokenize=False, add_generation_prompt=True))
        answer = [{"role": "assistant", "content": [{"type": "text", "text": completion}]}]
        completions.append(processor.apply_chat_template(user + answer, tokenize=False)[len(heads[-1]) :])
    pictures = [row[0] for row in rows]
    others = completions[-1:] + completions[:-1]  # (the mismatched rows: each prompt with the previous completion)
    policy_logps, reference_logps = (completion_logps(m, processor, heads, completions, pictures) for m in models)
    policy_kl, reference_kl = (completion_logps(m, processor, heads, others, pictures) for m in models)
    z0 = (policy_kl - reference_kl).mean().clamp(min=0)
    rho = policy_logps - reference_logps
    desirable = torch.tensor([row[3] for row in rows])
    losses = torch.where(desirable, 1 - torch.sigmoid(BETA * (rho - z0)), 1 - torch.sigmoid(BETA * (z0 - rho)))
    return losses.mean().item(), z0.item()


def test_kto_loss_equals_transformers_forwards_of_the_rows(make_trainer, tmp_path: Path) -> None:
    policy = vlm_folder("mllama", tmp_path / "policy", seed=2)
    reference = vlm_folder("mllama", tmp_path / "reference", seed=3)
    rows = write_rows(tmp_path)
    expected, z0 = reference_kto_loss(policy, reference, rows)

    run = tmp_path / "run"
    args = ["--job.dump_folder", str(run), "--job.no_print_config", "--metrics.log_freq", "1", "--checkpoint.no_enable"]
    args += ["--training.seq_len", "64", "--training.mixed_precision_param", "float32"]
    args += ["--checkpoint.initial_load_path", str(policy), "--checkpoint.initial_load_in_hf"]
    args += ["--data.path", str(tmp_path / "rows.jsonl"), "--data.kind", "unpaired", "--training.objective", "kto"]
    args += ["--training.local_batch_size", str(len(ROWS)), "--training.steps", "1"]
    trainer = with_reference(make_trainer(*args), reference)
    trainer.train()
    trainer.metrics.close()  # (flushes every scalar of the step)
    loss, kl = scalars(run / "tb")[1], scalars(run / "tb", "kto/kl")[1]
    print(f"mllama: titanium {loss:.8f} (kl {kl:.6f}), transformers {expected:.8f} (kl {z0:.6f})")  # (the docs)
    assert z0 > 0.1  # (the mismatched rows move the loss)
    assert kl == pytest.approx(z0, abs=1e-5)
    assert loss == pytest.approx(expected, rel=1e-5)


def examples_of(tmp_path: Path, rows: list[dict], seq_len: int = 64):
    from titanium.config.sections import DataSection
    from titanium.config.vision_section import VisionSection
    from titanium.data.vision import ImageData, load_processor
    from titanium.data.vision_unpaired import VisionUnpairedDataset

    folder = vlm_folder("gemma3", tmp_path / "model", seed=1)
    random_image(0, 28, 28).save(tmp_path / "a.png")
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = DataSection(path=str(tmp_path / "rows.jsonl"), kind="unpaired")
    images = ImageData(load_processor(folder, "--checkpoint.initial_load_path"), VisionSection())
    return VisionUnpairedDataset(data, images, seq_len)


def test_bad_unpaired_rows_are_skipped_and_counted(tmp_path: Path) -> None:
    from titanium.data.preference import OnePass

    two_parts = unpaired("w1", "w2", True, ["a.png"])
    two_parts["prompt"][0]["content"] = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "w1"}]
    rows = [
        unpaired("w1", "w2", True, ["a.png"]),
        unpaired("w1", "w2", True, ["missing.png"]),  # (no such file)
        two_parts,  # (two image placeholders, one image)
        unpaired("w1", "w2", "yes", ["a.png"]),  # (a label that is not true or false)
        {"prompt": "w1", "completion": [{"role": "assistant", "content": "w2"}], "label": False, "images": ["a.png"]},
        unpaired("w4", "w5 w6", False, []),  # (a text row: the model reads it without images)
    ]
    dataset = examples_of(tmp_path, rows)
    examples = list(OnePass(dataset))
    assert len(examples) == 2 and dataset.bad_rows == 4
    assert [e.desirable for e in examples] == [True, False]
    first, text = examples
    assert first.images["pixel_values"].shape[0] == 1 and first.images["token_type_ids"].sum() > 0
    assert text.images["token_type_ids"].sum() == 0  # (Gemma 3's processor gives a text row its token types)


def test_a_long_example_keeps_its_whole_prompt(tmp_path: Path) -> None:
    rows = [unpaired(" ".join(f"w{i}" for i in range(3, 30)), "w2", True, ["a.png"])]  # (the prompt fills 24)
    rows.append(unpaired("w1 w2", " ".join(f"w{i}" for i in range(3, 30)), True, ["a.png"]))
    dataset = examples_of(tmp_path, rows, seq_len=24)
    example = next(iter(dataset))
    assert (dataset.dropped, dataset.truncated) == (1, 1)
    assert len(example.prompt) + len(example.completion[0]) == 24
    assert example.images["token_type_ids"].shape[0] == 24 and example.images["token_type_ids"].sum() > 0
