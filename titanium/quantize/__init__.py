"""torchao converters that change how linear layers compute: Float8 training (float8.py) and quantization-aware
training (qat.py). Each is a ``ModelConverter`` (titanium/models/converter.py) built from its own config section."""

from __future__ import annotations

from collections.abc import Iterable

from titanium.config.errors import ConfigError


def filtered_by_name(name: str, patterns: Iterable[str]) -> bool:
    """Whether a layer stays as it is: its name contains one of ``patterns`` (``filter_fqns``: e.g. "output",
    "layers.0."), the convention of torchao's and torchtitan's float8 filters."""
    return any(pattern in name for pattern in patterns)


def check_filters_match(patterns: Iterable[str], layers: Iterable[str], flag: str) -> None:
    """A ``filter_fqns`` entry that no linear layer's name contains is a ``ConfigError`` naming ``flag``: the layer
    the user meant to keep in high precision would be converted after all (a typo, another family's name)."""
    layers = list(layers)
    for pattern in patterns:
        if not any(pattern in layer for layer in layers):
            shown = ", ".join(layers[:6]) + (", ..." if len(layers) > 6 else "")
            raise ConfigError(
                f"{flag}: {pattern!r} matches no linear layer of the model, so it keeps nothing in high precision; "
                f"the names look like {shown} (a pattern matches every layer whose name contains it)"
            )
