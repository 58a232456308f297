"""Image-text DPO's data and refusals (issue 41, item 5; the equality with TRL is tests/unit/test_vision_dpo_trl.py):
bad pair rows are skipped and counted, a pair's two samples share the prompt's tokens and pixel values, a long pair
keeps its whole prompt, and what pairs with images cannot do is refused before start-up (exit 2, naming the flag)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.objectives.tiny_vlm import random_image, vlm_folder

pytest.importorskip("transformers")


def pair(question: str, chosen: str, rejected: str, images: list[str]) -> dict:
    return {
        "prompt": [{"role": "user", "content": question}],
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
        "images": images,
    }


def pairs_dataset(tmp_path: Path, rows: list[dict], seq_len: int = 64, on_long_pair: str = "truncate"):
    from titanium.config.sections import DataSection
    from titanium.config.vision_section import VisionSection
    from titanium.data.vision import ImageData, load_processor
    from titanium.data.vision_preference import VisionPreferenceDataset

    folder = vlm_folder("gemma3", tmp_path / "model", seed=1)
    random_image(0, 28, 28).save(tmp_path / "a.png")
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = DataSection(path=str(tmp_path / "pairs.jsonl"), kind="preference")
    images = ImageData(load_processor(folder, "--checkpoint.initial_load_path"), VisionSection())
    return VisionPreferenceDataset(data, images, seq_len, on_long_pair=on_long_pair)


def test_bad_pair_rows_are_skipped_and_counted(tmp_path: Path) -> None:
    from titanium.data.preference import OnePass

    two_parts = pair("w1", "w2", "w3", ["a.png"])
    two_parts["prompt"][0]["content"] = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "w1"}]
    rows = [
        pair("w1", "w2", "w3", ["a.png"]),
        pair("w1", "w2", "w3", ["missing.png"]),  # (no such file)
        two_parts,  # (two image placeholders, one image)
        {"prompt": "w1", "chosen": [{"role": "assistant", "content": "w2"}], "rejected": "w3", "images": ["a.png"]},
        pair("w4", "w5 w6", "w7", []),  # (a text pair: the model reads it without images)
    ]
    dataset = pairs_dataset(tmp_path, rows)
    pairs = list(OnePass(dataset))
    assert len(pairs) == 2 and dataset.bad_rows == 3
    first = pairs[0]
    assert torch.equal(first.chosen["images"]["pixel_values"], first.rejected["images"]["pixel_values"])
    prompt = next(t for t, label in enumerate(first.chosen["labels"]) if label != -100) + 1
    assert first.chosen["tokens"][:prompt] == first.rejected["tokens"][:prompt]
    assert "pixel_values" not in pairs[1].chosen["images"]


def test_a_long_pair_keeps_its_prompt_and_cuts_its_responses(tmp_path: Path) -> None:
    rows = [pair("w1", " ".join(["w2"] * 30), "w3", ["a.png"]), pair("w1", "w2", "w3", ["a.png"])]
    dataset = pairs_dataset(tmp_path, rows, seq_len=24)
    cut = next(iter(dataset))
    assert len(cut.chosen["tokens"]) == 24 and dataset.truncated == 1
    assert cut.chosen["images"]["token_type_ids"].shape[0] == 24  # (per-token image fields cut with the tokens)
    assert cut.chosen["tokens"][:13] == cut.rejected["tokens"][:13]  # (the whole prompt)
    assert int(cut.chosen["images"]["token_type_ids"].sum()) == 4  # (its 4 image tokens)
    strict = pairs_dataset(tmp_path, rows, seq_len=24, on_long_pair="drop")
    assert len(next(iter(strict)).chosen["tokens"]) < 24 and strict.long_dropped == 1


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ([], "--dpo.share_prompt"),  # (on by default)
        (["--dpo.no_share_prompt", "--dpo.packing"], "--dpo.packing"),
        (["--dpo.no_share_prompt", "--dpo.precompute_reference"], "--dpo.precompute_reference"),
        (["--dpo.no_share_prompt", "--dpo.max_prompt_length", "16"], "--dpo.max_prompt_length"),
        (["--dpo.no_share_prompt", "--dpo.loss_type", "orpo"], "--dpo.loss_type orpo"),
    ],
)
def test_what_pairs_with_images_cannot_do_is_refused_before_start_up(flags, named, tmp_path: Path) -> None:
    from titanium.config.errors import ConfigError
    from titanium.inputs import load_job
    from titanium.preflight import check_job

    folder = vlm_folder("gemma3", tmp_path / "model", seed=1)
    (tmp_path / "pairs.jsonl").write_text(json.dumps(pair("w1", "w2", "w3", [])) + "\n")
    args = ["--job.dump_folder", str(tmp_path / "run"), "--checkpoint.initial_load_path", str(folder)]
    args += ["--checkpoint.initial_load_in_hf", "--data.path", str(tmp_path / "pairs.jsonl")]
    args += ["--data.kind", "preference", "--training.objective", "dpo", "--training.seq_len", "64", *flags]
    with pytest.raises(ConfigError, match=named):
        check_job(load_job(args), 1, "cpu")


def test_a_batch_of_text_pairs_trains_on_an_image_text_model(make_trainer, tmp_path: Path) -> None:
    """Pairs without images (a batch of them: Gemma 3's processor still gives their ``token_type_ids``) run the
    language model alone; the step-1 loss is log 2 (the reference is the policy's starting weights, fp32)."""
    from tests.helpers import scalars

    folder = vlm_folder("gemma3", tmp_path / "model", seed=1)
    (tmp_path / "pairs.jsonl").write_text(json.dumps(pair("w1 w2", "w3", "w4 w5", [])) + "\n")
    args = ["--job.dump_folder", str(tmp_path / "run"), "--checkpoint.initial_load_path", str(folder)]
    args += ["--checkpoint.initial_load_in_hf", "--data.path", str(tmp_path / "pairs.jsonl"), "--data.kind"]
    args += ["preference", "--training.objective", "dpo", "--dpo.no_share_prompt", "--training.seq_len", "64"]
    args += ["--training.steps", "1", "--training.local_batch_size", "1", "--training.mixed_precision_param", "float32"]
    args += ["--metrics.log_freq", "1", "--checkpoint.no_enable", "--job.no_print_config"]
    make_trainer(*args).train()
    assert scalars(tmp_path / "run" / "tb")[1] == pytest.approx(math.log(2), rel=1e-6)
