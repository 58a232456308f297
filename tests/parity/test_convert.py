"""titanium.tools.convert: HF -> DCP -> HF gives back the source files; bad input fails clearly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_args
from tests.parity.harness import make_hf_checkpoint
from tests.parity.test_parity import CASES
from titanium.model_builder import ModelBuilder
from titanium.models import get_model_spec
from titanium.tools.convert import main

pytest.importorskip("transformers")


@pytest.mark.parametrize("case", [CASES[2], CASES[5]], ids=lambda c: c.id)
def test_hf_dcp_hf_round_trip(tmp_path: Path, case) -> None:
    source = tmp_path / "hf"
    make_hf_checkpoint(case, source)
    assert main(["from-hf", str(source), str(tmp_path / "ckpt"), "--model", case.model]) == 0
    step0 = tmp_path / "ckpt/step-0"
    assert (step0 / ".metadata").is_file()
    args = ["to-hf", str(step0), str(tmp_path / "out"), "--model", case.model, "--source", str(source)]
    assert main([*args, "--dtype", "float32"]) == 0
    for path in source.iterdir():
        assert (tmp_path / "out" / path.name).read_bytes() == path.read_bytes(), path.name
    # A flavor that is not the checkpoint's architecture fails, naming the shapes.
    assert main(["to-hf", str(step0), str(tmp_path / "bad"), "--model", case.model, "--flavor", "debugmodel"]) == 2
    assert not (tmp_path / "bad").exists()


def test_training_checkpoint_to_hf(make_trainer, tmp_path: Path) -> None:
    """A checkpoint the trainer wrote converts with --flavor alone and holds the trained weights."""
    trainer = make_trainer(*tiny_args(tmp_path / "run", "--training.steps", "1", "--checkpoint.enable"))
    trainer.train()
    step = tmp_path / "run/checkpoint/step-1"
    assert main(["to-hf", str(step), str(tmp_path / "hf"), "--model", "llama3", "--flavor", "debugmodel"]) == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    built = ModelBuilder(torch.device("cpu")).load_hf(get_model_spec("llama3"), tmp_path / "hf")
    model, args = built.model, built.args
    assert args.vocab_size == trainer.model_args.vocab_size
    trained = trainer.model.state_dict()
    for key, value in model.state_dict().items():  # float32 by default, as a run's own export: exactly
        assert torch.equal(value, trained[key]), key


def test_errors_and_help(tmp_path: Path, capsys) -> None:
    assert main(["to-hf", str(tmp_path), str(tmp_path / "out"), "--model", "llama3", "--flavor", "1B"]) == 2
    assert "not a complete DCP checkpoint" in capsys.readouterr().err
    result = subprocess.run(
        [sys.executable, "-m", "titanium.tools.convert", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "to-hf" in result.stdout and "from-hf" in result.stdout
    # No library noise a user cannot act on (torchao's kernel libraries for other machines, torch's pytree notes).
    assert "Failed to load" not in result.stderr and "Enum subclass" not in result.stderr, result.stderr
