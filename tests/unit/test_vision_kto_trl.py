"""Image-text KTO against TRL 1.16 (issue 41, items 2 and 5): on the same four unpaired rows (one or two images each,
of two sizes; TRL's conversational form, and its plain form), titanium's first KTO batch equals the batch of the
collator ``KTOTrainer`` builds for a vision dataset (``DataCollatorForVisionUnpairedPreference``): token ids, learned
tokens, pixel values and ``token_type_ids`` of the rows and of the KL estimate's mismatched rows (each prompt with the
previous row's completion, reading the prompt's images), exactly; and over 5 steps on those rows titanium's logged
losses and KL estimates equal what ``KTOTrainer.train`` computes, the reference a second tiny model (other weights)
in both, with the optimizer settings made alike (fp32; losses 1e-5 relative, KL estimates 1e-5 absolute: a difference
of log-prob sums near -10, measured within 2e-6). The seeds make the KL estimate positive at
steps 1 and 2 (clamped to 0 after), so the mismatched rows' log-probs move those losses.

Tiny Gemma 3 only: for Llama 3.2 Vision TRL's batch is not a consistent one (its processor puts a BOS before the
separately processed completion, and the cross-attention mask stays as long as the prompt; docs/vision.md), so its
KTO loss is compared with ``transformers``' forwards of each row instead (tests/unit/test_vision_kto.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import scalars
from tests.objectives.tiny_vlm import assert_image_fields_equal, random_image, vlm_folder, with_reference
from tests.unit.test_vision_trl import trl_settings

pytest.importorskip("transformers")
pytest.importorskip("trl", reason="pip install 'trl>=1.16,<2' (in the dev extra) to compare with TRL")

STEPS, LR = 5, 1e-3
ROWS = [
    ([28], "w5 w6", "w7 w8", True),
    ([56, 28], "w1", "w2 w3 w4", False),
    ([28], "w3 w4 w10", "w11", True),
    ([56], "w12", "w6 w9 w13 w14", False),
]
"""(image widths, question, completion, label): every step's batch."""
KL_TEXT_KEYS = {"KL_input_ids", "KL_attention_mask", "KL_completion_mask", "KL_token_type_ids"}


def write_rows(folder: Path, plain: str | None = None) -> list[dict]:
    """The rows as a jsonl file with PNG images beside it (titanium's input), and as TRL's rows with the same images
    decoded. ``plain``: TRL's plain form instead, the prompt starting with this image placeholder once per image,
    the completion with a space (the texts are joined as they are)."""
    from PIL import Image

    ours, theirs = [], []
    for i, (widths, question, completion, label) in enumerate(ROWS):
        names = []
        for k, width in enumerate(widths):
            names.append(f"image{i}_{k}.png")
            random_image(10 * i + k, width, 28).save(folder / names[-1])
        row = {
            "prompt": [{"role": "user", "content": question}],
            "completion": [{"role": "assistant", "content": completion}],
            "label": label,
        }
        if plain is not None:
            row = {
                "prompt": " ".join([plain] * len(widths) + [question]),
                "completion": f" {completion}",
                "label": label,
            }
        ours.append({**row, "images": names})
        theirs.append({**row, "images": [Image.open(folder / n).convert("RGB") for n in names]})
    (folder / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ours))
    return theirs


def trl_trainer(policy: Path, reference: Path, rows: list[dict], output: Path):
    """``KTOTrainer`` on the Hugging Face folders as TRL configures it for a vision dataset (its processor loaded by
    TRL from the policy's folder; the collator, the KTO loss and beta its defaults), every step on all the rows."""
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText
    from trl import KTOConfig, KTOTrainer

    args = KTOConfig(**trl_settings(output, rows, STEPS, LR))
    return KTOTrainer(
        model=AutoModelForImageTextToText.from_pretrained(policy, dtype=torch.float32),
        ref_model=AutoModelForImageTextToText.from_pretrained(reference, dtype=torch.float32),
        args=args,
        train_dataset=Dataset.from_list(rows),
    )


def titanium_args(folder: Path, data: Path, run: Path) -> list[str]:
    args = ["--job.dump_folder", str(run), "--job.no_print_config", "--metrics.log_freq", "1", "--checkpoint.no_enable"]
    args += ["--training.seq_len", "64", "--training.mixed_precision_param", "float32"]
    args += ["--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf"]
    args += ["--data.path", str(data), "--data.kind", "unpaired", "--training.objective", "kto"]
    args += ["--training.local_batch_size", str(len(ROWS)), "--training.steps", str(STEPS)]
    args += ["--optimizer.lr", str(LR), "--optimizer.beta2", "0.999", "--optimizer.weight_decay", "0"]
    return args + ["--lr_scheduler.warmup_steps", "0", "--lr_scheduler.min_lr_factor", "1", "--training.max_norm", "1"]


def assert_rows_equal(tokens: torch.Tensor, labels: torch.Tensor, theirs: dict, prefix: str) -> torch.Tensor:
    """titanium's rows (ids, shifted labels) equal TRL's ``prefix`` rows where its attention mask is 1 (titanium pads
    wider, to a multiple of 8); returns that mask."""
    real = theirs[f"{prefix}attention_mask"].bool()
    width = real.shape[1]
    assert tokens.shape[0] == real.shape[0] and tokens.shape[1] >= width
    assert torch.equal(tokens[:, :width][real], theirs[f"{prefix}input_ids"][real])
    learned = theirs[f"{prefix}completion_mask"][:, 1:].bool()  # (titanium's labels: position t holds token t + 1's)
    assert torch.equal(labels[:, : width - 1] != -100, learned) and (labels[:, width - 1 :] == -100).all()
    assert torch.equal(labels[:, : width - 1][learned], theirs[f"{prefix}input_ids"][:, 1:][learned])
    return real


@pytest.mark.parametrize("plain", [None, "<start_of_image>"])
def test_kto_batch_and_losses_equal_trl(plain: str | None, make_trainer, tmp_path: Path) -> None:
    from trl.trainer.kto_trainer import DataCollatorForVisionUnpairedPreference

    policy = vlm_folder("gemma3", tmp_path / "policy", seed=3)
    reference = vlm_folder("gemma3", tmp_path / "reference", seed=2)
    rows = write_rows(tmp_path, plain)
    trl = trl_trainer(policy, reference, rows, tmp_path / "trl")
    assert isinstance(trl.data_collator, DataCollatorForVisionUnpairedPreference)
    theirs = trl.data_collator([dict(row) for row in trl.train_dataset])
    trl_losses: list[float] = []
    trl_kl: list[float] = []
    compute_loss = trl.compute_loss

    def recorded(*args, **kwargs) -> torch.Tensor:
        loss = compute_loss(*args, **kwargs)
        trl_losses.append(loss.item())
        trl_kl.append(trl._metrics["train"]["kl"][-1])  # (the step's KL estimate, clamped at 0 as logged)
        return loss

    trl.compute_loss = recorded
    trl.train()

    run = tmp_path / "run"
    trainer = make_trainer(*titanium_args(policy, tmp_path / "rows.jsonl", run))
    ours = trainer._new_objective(trainer.cfg.data).next_microbatch()  # (a fresh copy of the first batch)
    layout = trainer.objective.ctx.processor.layout
    assert torch.equal(ours.fields.desirable, theirs["label"])
    real = assert_rows_equal(ours.tokens, ours.fields.labels, theirs, "")
    text = {"input_ids", "attention_mask", "completion_mask", "label"} | KL_TEXT_KEYS
    assert_image_fields_equal(ours.images, theirs, layout, real, real.shape[1], text)
    mismatched = ours.fields.mismatched
    real = assert_rows_equal(mismatched.tokens, mismatched.fields.labels, theirs, "KL_")
    kl_images = {"pixel_values": theirs["pixel_values"], "token_type_ids": theirs["KL_token_type_ids"]}
    assert_image_fields_equal(mismatched.images, kl_images, layout, real, real.shape[1], set())

    with_reference(trainer, reference).train()
    trainer.metrics.close()  # (flushes every scalar of the steps)
    losses, kl = scalars(run / "tb"), scalars(run / "tb", "kto/kl")
    print(f"{plain}: titanium {losses} {kl} TRL {trl_losses} {trl_kl}")  # (the docs)
    assert [losses[step] for step in range(1, STEPS + 1)] == pytest.approx(trl_losses, rel=1e-5), (losses, trl_losses)
    assert [kl[step] for step in range(1, STEPS + 1)] == pytest.approx(trl_kl, abs=1e-5), (kl, trl_kl)
    assert trl_kl[0] > 0.1  # (at step 1 the KL estimate is not clamped away: the mismatched rows move the loss)
