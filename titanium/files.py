"""File-system helpers shared by every writer of folders that must appear complete or not at all."""

from __future__ import annotations

import shutil
from pathlib import Path


def replace_folder(partial: Path, final: Path) -> None:
    """Swap a finished ``partial`` folder into place; a reader never sees a half-written ``final``."""
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    partial.rename(final)
    shutil.rmtree(old, ignore_errors=True)
