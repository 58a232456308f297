"""torchao converters that change how linear layers compute: Float8 training (float8.py) and quantization-aware
training (qat.py). Each is a ``ModelConverter`` (titanium/models/converter.py) built from its own config section."""

from __future__ import annotations

from collections.abc import Iterable


def filtered_by_name(name: str, patterns: Iterable[str]) -> bool:
    """Whether a layer stays as it is: its name contains one of ``patterns`` (``filter_fqns``: e.g. "output",
    "layers.0."), the convention of torchao's and torchtitan's float8 filters."""
    return any(pattern in name for pattern in patterns)
