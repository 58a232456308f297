"""Rows with images given to a text model stop the run (exit 2, one message naming the row and the fix), instead of
training on the rows' text with their images dropped without a word (issue 41, item 8). The bundled shapes task
(``assets/tasks/shapes``: TRL-format rows whose ``images`` column names Pillow-drawn files) is the data; the model is
the debug text model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import REPO, scalars, tiny_args
from titanium.data.text import DataError

SHAPES = REPO / "assets/tasks/shapes/train.jsonl"


def test_sft_on_rows_with_images_stops_a_text_model(tmp_path: Path, capsys) -> None:
    from titanium.train import main

    args = ("--training.objective", "sft", "--data.kind", "chat", "--data.path", str(SHAPES), "--training.steps", "1")
    assert main(tiny_args(tmp_path, *args, "--chat.chat_template", "llama3")) == 2
    err = capsys.readouterr().err
    assert f"--data.path {SHAPES}: row 0 has images (its 'images' column), but the model reads text only" in err, err
    assert "start from an image-text model's folder" in err and "Traceback" not in err
    with pytest.raises(KeyError):  # (no step trained: no loss logged)
        scalars(tmp_path / "tb")


def test_preference_rows_with_one_image_stop_a_text_model(make_trainer, tmp_path: Path) -> None:
    row = {"prompt": "w1", "chosen": "w2", "rejected": "w3", "image": "images/train_000.png"}
    (tmp_path / "pairs.jsonl").write_text(json.dumps(row) + "\n")
    args = ("--training.objective", "dpo", "--data.kind", "preference", "--data.path", str(tmp_path / "pairs.jsonl"))
    trainer = make_trainer(*tiny_args(tmp_path / "run", *args, "--training.steps", "1"))
    with pytest.raises(DataError, match="row 0 has images \\(its 'image' column\\), but the model reads text only"):
        trainer.train()
