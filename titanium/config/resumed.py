"""Resuming into a folder whose run was configured otherwise: name the keys that change what the run computes.

A run writes its resolved config to ``job.dump_folder/config.toml``. Started again into that folder it resumes
the checkpoint there, whatever its config says now, so a changed learning rate, data file or model would go
unremarked (or, past the last step, the run says only "nothing to do"). Before the new config is written over the
old one, the keys that differ are named in a warning; keys that do not change the results (steps, logging,
checkpoint interval, the parallel layout, which DCP reshards) are left out. A warning, not an error: changing the
learning rate or the data mid-run is legitimate, resuming into the wrong folder is the mistake to catch.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

logger = logging.getLogger("titanium")

NEUTRAL_SECTIONS = frozenset(
    {"job", "metrics", "comm", "profiling", "eval", "validation", "parallelism", "compile", "activation_checkpoint"}
)
"""Sections that change how a run is computed, watched or laid out, not what it computes."""
NEUTRAL_KEYS = frozenset(
    {
        "training.steps",
        "training.gc_freq",
        "training.loss_chunk_size",
        "data.prefetch_batches",
        *(f"guards.{key}" for key in ("max_skipped_steps", "loss_spike_ratio", "loss_spike_window")),
        *(
            f"checkpoint.{key}"
            for key in (
                "enable",
                "folder",
                "interval",
                "keep_latest_k",
                "load_step",
                "async_mode",
                "create_seed_checkpoint",
                "last_save_model_only",
                "exclude_from_loading",
                "last_save_in_hf",
                "hf_folder",
                "export_dtype",
                "export_at_saves",
                "push_to_hub",
            )
        ),  # fmt: skip
    }
)
"""Keys of other sections that do not change the results (steps: extending a run is what resuming is for)."""


def changed_keys(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``section.key saved -> current`` for each key of ``current`` (a config as ``to_toml_dict`` gives it) that
    ``saved`` holds with another value and that changes results. Keys only one side has (another titanium
    version, an option left at None) are not compared."""
    changes = []
    for section, values in current.items():
        old = saved.get(section)
        if section in NEUTRAL_SECTIONS or not isinstance(values, dict) or not isinstance(old, dict):
            continue
        for key, value in values.items():
            name = f"{section}.{key}"
            if key in old and old[key] != value and name not in NEUTRAL_KEYS:
                changes.append(f"{name} {old[key]!r} -> {value!r}")
    return changes


def warn_if_changed(saved_config: Path, current: Mapping[str, Any]) -> None:
    """Warn, naming the keys, when the run about to resume from the checkpoints beside ``saved_config`` (its
    config.toml) is configured differently in a way that changes its results."""
    try:
        saved = tomllib.loads(saved_config.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return  # (no config saved beside the checkpoints, or not ours: nothing to compare)
    changes = changed_keys(saved, current)
    if changes:
        logger.warning(
            "resuming the run in %s with a config that differs from the one it ran with (%s) in keys that change its "
            "results: %s. The run continues from its checkpoint with these values; to start a new run instead, use "
            "another --job.dump_folder",
            saved_config.parent,
            saved_config,
            "; ".join(changes),
        )
