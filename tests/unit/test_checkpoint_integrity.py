"""checkpoint_problem finds a DCP checkpoint's missing, truncated or unreadable files before loading."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titanium.checkpoint.manager import CheckpointError, check_checkpoint, checkpoint_problem


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
