"""checkpoint_problem finds a DCP checkpoint's missing, truncated or unreadable files before loading, and a model
checkpoint of another architecture is named with its differences, for frozen copies as for the policy."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titanium.checkpoint.manager import CheckpointError, check_checkpoint, checkpoint_problem
from titanium.checkpoint.states import ModelState
from titanium.errors import UserError
from titanium.model_builder import ModelBuilder, WeightSource
from titanium.models import get_model_spec


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "step-3"
    dcp.save({"w": torch.arange(1000.0), "b": torch.ones(10)}, checkpoint_id=str(path), no_dist=True)
    return path


def test_a_whole_checkpoint_has_no_problem(checkpoint):
    assert checkpoint_problem(checkpoint) is None
    assert check_checkpoint(checkpoint, "--flag") == checkpoint


def test_truncated_and_missing_data_files(checkpoint):
    data = next(checkpoint.glob("*.distcp"))
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size - 100)
    assert checkpoint_problem(checkpoint) == (
        f"{data.name} is truncated ({size - 100:,} bytes; .metadata places {size:,} bytes in it)"
    )
    data.unlink()
    assert checkpoint_problem(checkpoint) == f"{data.name} is missing"


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_unreadable_metadata(checkpoint, damage):
    metadata = checkpoint / ".metadata"
    content = metadata.read_bytes()
    metadata.write_bytes({"truncate": content[: len(content) // 2], "garbage": b"\x00" * 64, "empty": b""}[damage])
    problem = checkpoint_problem(checkpoint)
    assert problem is not None and problem.startswith(".metadata cannot be read ("), problem


def test_not_a_checkpoint_folder(tmp_path, checkpoint):
    assert checkpoint_problem(tmp_path / "nope") == "not found"
    (tmp_path / "file").write_text("x")
    assert checkpoint_problem(tmp_path / "file") == "not a folder"
    problem = checkpoint_problem(tmp_path)  # the folder that holds step-3
    assert problem is not None and "no .metadata" in problem and f"such as {checkpoint}" in problem
    shutil.rmtree(checkpoint)
    with pytest.raises(CheckpointError, match=f"--flag: checkpoint {tmp_path}: no .metadata"):
        check_checkpoint(tmp_path, "--flag")


def _model_checkpoint(path, name: str):
    """A titanium checkpoint (model weights only) of the debug flavor of family ``name``, and its state dict."""
    spec = get_model_spec(name)
    model = ModelBuilder(torch.device("cpu"), seed=3).build(spec, _debug_args(spec)).model
    dcp.save({"model": ModelState(model)}, checkpoint_id=str(path), no_dist=True)
    return model.state_dict()


def _debug_args(spec):
    return dataclasses.replace(spec.flavors["debugmodel"], max_seq_len=32)


def test_a_frozen_copy_is_loaded_through_the_policys_checks(tmp_path):
    """A reference (or any frozen model) read from a titanium checkpoint: the same weights from a checkpoint of the
    model, and from one of another architecture one message naming the folder and the differing tensors (it used
    to be DCP's Size mismatch traceback when the reference first ran)."""
    spec = get_model_spec("llama3")
    builder = ModelBuilder(torch.device("cpu"), seed=0)
    same, other = tmp_path / "llama3" / "step-1", tmp_path / "qwen3" / "step-1"
    saved = _model_checkpoint(same, "llama3")
    _model_checkpoint(other, "qwen3")
    frozen = builder.frozen_copy(
        spec, _debug_args(spec), WeightSource(dcp_folder=str(same)), converters=[], batch_size=1
    )
    for name, value in frozen.built.model.state_dict().items():
        assert torch.equal(value, saved[name]), name
    with pytest.raises(CheckpointError) as error:
        builder.frozen_copy(spec, _debug_args(spec), WeightSource(dcp_folder=str(other)), converters=[], batch_size=1)
    message = str(error.value)
    assert message.startswith(f"--checkpoint.initial_load_path: checkpoint {other} holds a model of another")
    assert "layers.0.attention.wq.weight [512, 256] (the model's is [256, 256])" in message
    assert isinstance(error.value, UserError)  # (exit code 2, no traceback)
    with pytest.raises(CheckpointError, match="no .metadata"):
        builder.frozen_copy(
            spec, _debug_args(spec), WeightSource(dcp_folder=str(tmp_path)), converters=[], batch_size=1
        )
