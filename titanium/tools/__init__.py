"""Command-line tools around training: dry run, conversion, generation, evaluation."""

from __future__ import annotations

import torch

from titanium.errors import UserError


def requested_device(name: str | None) -> torch.device:
    """A tool's ``--device``: ``name`` (cpu, cuda, cuda:1, ...), by default the GPU when there is one; a device
    this machine lacks is a ``UserError`` naming the flag, before any model is loaded."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(f"--device {name}: this machine has no CUDA GPU that torch can use; use --device cpu")
        if device.index is not None and device.index >= count:
            raise UserError(f"--device {name}: this machine has {count} CUDA GPU(s) (cuda:0..cuda:{count - 1})")
    elif device.type != "cpu":
        raise UserError(f"--device {name}: the tools run on cpu or cuda")
    return device
