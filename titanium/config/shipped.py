"""The files titanium ships (its assets/ and train_configs/) found from any working directory."""

from __future__ import annotations

from glob import glob
from pathlib import Path

SHIPPED_ROOT = Path(__file__).resolve().parents[2]
"""The folder the titanium package sits in: in a checkout (and its editable install), the repository, whose assets/
and train_configs/ hold the bundled tokenizers, datasets and configs."""
SHIPPED_FOLDERS = ("assets", "train_configs")


def shipped(path: str) -> str:
    """``path`` (a file, folder or glob) as typed when it names something from where the user stands, is absolute or
    is outside the bundled folders; else, for ``assets/...`` or ``train_configs/...`` that the repository has, the
    repository's: the defaults and the documented commands then work from any directory, and a user's own
    ``assets/`` folder still wins."""
    parts = Path(path).parts
    if not parts or parts[0] not in SHIPPED_FOLDERS or glob(path):
        return path
    bundled = str(SHIPPED_ROOT / path)
    return bundled if glob(bundled) else path
