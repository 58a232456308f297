"""Image-text DPO against TRL 1.16 (issue 41, items 5 and 6): on the same three pairs (one or two images each, of two
sizes; one image set shared by a pair's two sides; TRL's conversational form, and for Gemma 3 its plain form),
titanium's first DPO batch equals the batch of the collator ``DPOTrainer`` builds for a vision dataset
(``DataCollatorForVisionPreference``): token ids, which tokens are learned, pixel values and every other image tensor
(Qwen-VL's ``image_grid_thw`` and ``mm_token_type_ids`` too), exactly; and over 10 steps on those pairs
titanium's logged losses equal the losses ``DPOTrainer.train`` computes (``compute_loss``), with the optimizer
settings made alike (those of tests/unit/test_vision_trl.py; fp32, 1e-5 relative), the reference model a second tiny
model (other weights) in both, so that the loss is not log 2. Both models read the pair's pixels: another image for
one pair moves the loss.

For Llama 3.2 Vision TRL's batch cannot run as it is: its processor puts a BOS before the separately processed
response, and the cross-attention mask stays as long as the (left-padded) prompt, so the forward fails. The test
compares titanium's ids with TRL's less that BOS, and trains TRL on its batch repaired: the processor's own ids and
cross-attention mask for each prompt + response text, the response's tokens learned (docs/vision.md). The
Qwen-VL processors (Qwen2.5-VL, Qwen3-VL) need torchvision, which does not import beside torch 2.13 CPU: both
trainers get the tiny one built without its video processor (``tiny_processors.use_tiny_processors``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.helpers import scalars
from tests.objectives.tiny_processors import use_tiny_processors
from tests.objectives.tiny_vlm import assert_image_fields_equal, random_image, vlm_folder, with_reference
from tests.unit.test_vision_trl import record, trl_settings

pytest.importorskip("transformers")
pytest.importorskip("trl", reason="pip install 'trl>=1.16,<2' (in the dev extra) to compare with TRL")

PAIRS = [
    ([28], "w5 w6", "w7 w8", "w9"),
    ([56, 28], "w1", "w2 w3 w4", "w5 w6 w7 w8"),
    ([28], "w3 w4 w10", "w11", "w12 w6"),
]
"""(image widths, question, chosen answer, rejected answer): every step's batch, TRL's conversational form."""
STEPS, LR = 10, 1e-3


def write_pairs(folder: Path, seed: int = 0, plain: str | None = None) -> list[dict]:
    """The pairs as a jsonl file with PNG images beside it (titanium's input), and as TRL's rows with the same images
    decoded. ``seed`` draws the images (another seed: other pictures, the same text). ``plain``: TRL's plain form
    instead, three strings, the prompt starting with this image placeholder once per image, each response with a
    space (the texts are joined as they are)."""
    from PIL import Image

    ours, theirs = [], []
    for i, (widths, question, chosen, rejected) in enumerate(PAIRS):
        names = []
        for k, width in enumerate(widths):
            names.append(f"image{seed}_{i}_{k}.png")
            random_image(seed * 100 + 10 * i + k, width, 28).save(folder / names[-1])
        row = {
            "prompt": [{"role": "user", "content": question}],
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}],
        }
        if plain is not None:
            row = {"prompt": " ".join([plain] * len(widths) + [question]), "chosen": f" {chosen}"}
            row["rejected"] = f" {rejected}"
        ours.append({**row, "images": names})
        theirs.append({**row, "images": [Image.open(folder / n).convert("RGB") for n in names]})
    (folder / f"pairs{seed}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ours))
    return theirs


def trl_trainer(policy: Path, reference: Path, rows: list[dict], output: Path):
    """``DPOTrainer`` on the Hugging Face folders as TRL configures it for a vision dataset (its processor loaded by
    TRL from the policy's folder with ``AutoProcessor``; the collator and the sigmoid loss TRL's defaults), every
    step on all the pairs."""
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText
    from trl import DPOConfig, DPOTrainer

    model = AutoModelForImageTextToText.from_pretrained(policy, dtype=torch.float32)
    ref_model = AutoModelForImageTextToText.from_pretrained(reference, dtype=torch.float32)
    args = DPOConfig(**trl_settings(output, rows, STEPS, LR))
    return DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=Dataset.from_list(rows))


def whole_texts_batch(rows: list[dict], processor, theirs: dict) -> dict:
    """Llama 3.2 Vision: TRL's batch as it would be with each side processed whole (chosen rows, then rejected, as
    TRL orders them): the processor's ids, masks and images for prompt + response, the response's tokens learned.
    Asserts that its ids are TRL's less the BOS TRL's processor put before each response."""
    from trl.data_utils import apply_chat_template, prepare_multimodal_messages

    prompts, texts = [], []
    for side in ("chosen", "rejected"):
        for row in rows:
            example = {
                "prompt": prepare_multimodal_messages(row["prompt"], images=row["images"]),
                "chosen": prepare_multimodal_messages(row["chosen"]),
                "rejected": prepare_multimodal_messages(row["rejected"]),
            }
            text = apply_chat_template(example, processor)
            prompts.append(text["prompt"])
            texts.append(text["prompt"] + text[side])
    images = [row["images"] for row in rows] * 2
    kwargs = dict(padding=True, padding_side="right", add_special_tokens=False, return_tensors="pt")
    batch = dict(processor(text=texts, images=images, **kwargs))
    prompt_lengths = [len(processor(text=[p], images=[i], **kwargs)["input_ids"][0]) for p, i in zip(prompts, images)]
    positions = torch.arange(batch["input_ids"].shape[1])[None, :]
    batch["completion_mask"] = batch["attention_mask"] * (positions >= torch.tensor(prompt_lengths)[:, None])

    bos = processor.tokenizer.bos_token_id
    for r, row_ids in enumerate(theirs["input_ids"]):
        real = row_ids[theirs["attention_mask"][r].bool()].tolist()
        first = prompt_lengths[r]
        assert real[first] == bos, "TRL's processor puts a BOS before the response"
        assert real[:first] + real[first + 1 :] == batch["input_ids"][r][batch["attention_mask"][r].bool()].tolist()
    return batch


def titanium_args(folder: Path, data: Path, run: Path, steps: int = 1) -> list[str]:
    args = ["--job.dump_folder", str(run), "--job.no_print_config", "--metrics.log_freq", "1", "--checkpoint.no_enable"]
    args += ["--training.seq_len", "64", "--training.mixed_precision_param", "float32"]
    args += ["--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf"]
    args += ["--data.path", str(data), "--data.kind", "preference", "--training.objective", "dpo"]
    args += ["--dpo.no_share_prompt"]  # (refused with images)
    args += ["--training.local_batch_size", str(len(PAIRS)), "--training.steps", str(steps)]
    args += ["--optimizer.lr", str(LR), "--optimizer.beta2", "0.999", "--optimizer.weight_decay", "0"]
    return args + ["--lr_scheduler.warmup_steps", "0", "--lr_scheduler.min_lr_factor", "1", "--training.max_norm", "1"]


def first_loss(make_trainer, folder: Path, reference: Path | None, data: Path, run: Path) -> float:
    """titanium's logged step-1 DPO loss (its process group shut down after, for the next run in this process)."""
    from titanium.parallel.distributed import shutdown_distributed

    trainer = make_trainer(*titanium_args(folder, data, run))
    if reference is not None:
        with_reference(trainer, reference)
    trainer.train()
    shutdown_distributed()
    return scalars(run / "tb")[1]


@pytest.mark.parametrize(
    ("model_type", "plain"),
    [("mllama", None), ("gemma3", None), ("gemma3", "<start_of_image>"), ("qwen2_5_vl", None), ("qwen3_vl", None)],
)
def test_dpo_batch_and_losses_equal_trl(
    model_type: str, plain: str | None, make_trainer, monkeypatch, tmp_path: Path
) -> None:
    from trl.trainer.dpo_trainer import DataCollatorForVisionPreference

    use_tiny_processors(monkeypatch)
    policy = vlm_folder(model_type, tmp_path / "policy", seed=2)
    reference = vlm_folder(model_type, tmp_path / "reference", seed=3)
    rows = write_pairs(tmp_path, plain=plain)
    trl = trl_trainer(policy, reference, rows, tmp_path / "trl")
    assert isinstance(trl.data_collator, DataCollatorForVisionPreference)
    theirs = trl.data_collator([dict(row) for row in trl.train_dataset])
    if model_type == "mllama":
        theirs = whole_texts_batch(rows, trl.processing_class, theirs)
        repaired = theirs
        trl.data_collator = lambda examples: dict(repaired)  # (every step: all the pairs, TRL's order)
    trl_losses = []
    compute_loss = trl.compute_loss
    trl.compute_loss = lambda *args, **kwargs: record(trl_losses, compute_loss(*args, **kwargs))
    trl.train()

    run = tmp_path / "run"
    trainer = make_trainer(*titanium_args(policy, tmp_path / "pairs0.jsonl", run, STEPS))
    ours = trainer._new_objective(trainer.cfg.data).next_microbatch()  # (a fresh copy of the first batch)
    layout = trainer.objective.ctx.processor.layout
    n = len(PAIRS)
    order = [k for i in range(n) for k in (i, n + i)]  # (titanium: a pair's two rows together; TRL: chosen, rejected)
    counts = [len(row["images"]) for row in rows] * 2
    grids = theirs.get("image_grid_thw")  # (Qwen: pixel_values holds every image's patches, grid t * h * w each)
    patches = [int(g.prod(-1).sum()) for g in grids.split(counts)] if grids is not None else None

    def in_our_order(name: str, value: torch.Tensor) -> torch.Tensor:
        if name in layout.token or name in layout.batched:
            return value[order]  # (one entry per row)
        if value.shape[0] == sum(counts):
            parts = value.split(counts)  # (every image of the batch: TRL's chosen rows' images, then the rejected's)
        elif patches is not None and value.shape[0] == sum(patches):
            parts = value.split(patches)
        else:
            return value[order]  # (the text's: ids, masks)
        return torch.cat([parts[k] for k in order])

    theirs = {name: in_our_order(name, value) for name, value in theirs.items()}
    real = theirs["attention_mask"].bool()
    width = real.shape[1]
    assert ours.rows == 2 * n and ours.tokens.shape[1] >= width
    assert torch.equal(ours.tokens[:, :width][real], theirs["input_ids"][real])
    labels = ours.fields.labels  # (shifted in the data: position t holds the label of token t + 1)
    learned = theirs["completion_mask"][:, 1:].bool()
    assert torch.equal(labels[:, : width - 1] != -100, learned) and (labels[:, width - 1 :] == -100).all()
    assert torch.equal(labels[:, : width - 1][learned], theirs["input_ids"][:, 1:][learned])

    assert_image_fields_equal(
        ours.images, theirs, layout, real, width, {"input_ids", "attention_mask", "completion_mask"}
    )

    with_reference(trainer, reference).train()
    losses = scalars(run / "tb")
    ours_losses = [losses[step] for step in range(1, STEPS + 1)]
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours_losses, trl_losses))
    print(f"{model_type} {plain}: titanium {ours_losses} TRL {trl_losses} largest relative difference {worst:.2g}")
    assert ours_losses == pytest.approx(trl_losses, rel=1e-5), (ours_losses, trl_losses)
    assert abs(ours_losses[0] - math.log(2)) > 1e-3  # (the reference's other weights move it off log 2)


@pytest.mark.parametrize("model_type", ["mllama", "gemma3", "qwen2_5_vl"])
def test_both_models_read_the_pairs_images(model_type: str, make_trainer, monkeypatch, tmp_path: Path) -> None:
    """Another picture for one pair moves the step-1 loss; with the reference the policy's starting weights (the
    default) the loss is log 2 exactly, as it is only when the reference reads the same pixel values as the policy."""
    use_tiny_processors(monkeypatch)
    policy = vlm_folder(model_type, tmp_path / "policy", seed=2)
    reference = vlm_folder(model_type, tmp_path / "reference", seed=3)
    write_pairs(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "pairs0.jsonl").read_text().splitlines()]
    rows[0]["images"] = rows[2]["images"]  # (pair 0 asks about pair 2's picture, of the same size)
    swapped = tmp_path / "swapped.jsonl"
    swapped.write_text("".join(json.dumps(row) + "\n" for row in rows))

    loss = first_loss(make_trainer, policy, reference, tmp_path / "pairs0.jsonl", tmp_path / "run")
    moved = first_loss(make_trainer, policy, reference, swapped, tmp_path / "swapped")
    print(f"{model_type}: {loss:.8f} -> {moved:.8f} with pair 0's picture swapped")
    # (measured: Llama 3.2 Vision 2.2e-3, Gemma 3 8.1e-3 relative; Qwen2.5-VL 8.9e-5, its image one token of ~12)
    assert abs(moved - loss) > (1e-5 if model_type == "qwen2_5_vl" else 1e-4) * loss
    same = first_loss(make_trainer, policy, None, swapped, tmp_path / "same")
    assert same == pytest.approx(math.log(2), rel=1e-6)
