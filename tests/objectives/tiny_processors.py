"""``AutoProcessor`` giving ``tiny_vlm.tiny_processor`` for a folder of a tiny Qwen2.5-VL, Qwen3-VL or Llama 4
(``load_processor``). Their own processors need torchvision, which does not import beside torch 2.13 CPU here, so
without this ``titanium.train`` refuses such a folder (exit 2); with it, it trains them on rows with images. The
launches of ``python -m tests.objectives.fixed_rollouts`` load processors so; in a test's own process
``use_tiny_processors`` makes the same change for the test (titanium's ``Trainer`` and TRL's trainers, which both load
the folder's processor with ``AutoProcessor``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import transformers

from tests.objectives.tiny_vlm import tiny_processor

TORCHVISION_PROCESSORS = ("qwen2_5_vl", "qwen3_vl", "llama4")
_load = transformers.AutoProcessor.from_pretrained


def load_processor(folder: str | Path, *args: Any, **kwargs: Any) -> Any:
    """``AutoProcessor.from_pretrained``, or the tiny processor of a folder of one of ``TORCHVISION_PROCESSORS``."""
    config = Path(folder) / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    if model_type in TORCHVISION_PROCESSORS:
        return tiny_processor(model_type)
    return _load(folder, *args, **kwargs)


def use_tiny_processors(monkeypatch: Any) -> None:
    """``AutoProcessor.from_pretrained`` is ``load_processor`` until the test ends (``monkeypatch``: pytest's)."""
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", load_processor)
