"""The model registry itself: names to ``ModelSpec``s. The families register into it when imported
(``titanium.models`` imports the built-in ones), and import it without importing each other."""

from __future__ import annotations

import dataclasses
from typing import Any

from titanium.models.spec import ModelSpec

_REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec, *, replace: bool = False) -> ModelSpec:
    """Add ``spec`` under ``spec.name`` and return it.

    Registering a different spec under a taken name is an error unless ``replace`` is set,
    so two families cannot silently shadow each other.
    """
    existing = _REGISTRY.get(spec.name)
    if existing is not None and existing is not spec and not replace:
        raise ValueError(f"model {spec.name!r} is already registered; pass replace=True to override")
    _REGISTRY[spec.name] = spec
    return spec


def list_models() -> list[str]:
    """Registered model names, sorted."""
    return sorted(_REGISTRY)


def get_model_spec(name: str) -> ModelSpec:
    """The spec registered as ``name``; ``ValueError`` naming the known models otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(list_models()) or '(none)'}") from None


def default_chat_format(name: str) -> str:
    """The chat format family ``name`` registers for its instruct models ("" if none, or not a registered family):
    what ``--chat.chat_template auto`` uses when the tokenizer has no template of its own."""
    spec = _REGISTRY.get(name)
    return (spec.chat_template or "") if spec is not None else ""


def hf_family(model_type: object) -> str | None:
    """The registered family whose Hugging Face adapter reads ``config.json`` files of ``model_type``, if any."""
    for name in list_models():
        adapter = _REGISTRY[name].hf_adapter
        if adapter is not None and adapter.model_type == model_type:
            return name
    return None


def build_model_args(spec: ModelSpec, flavor: str, **overrides: Any) -> Any:
    """A copy of the ``flavor`` preset of ``spec`` with ``overrides`` applied.

    The trainer uses this to take ``vocab_size`` from the tokenizer and ``max_seq_len``
    from the training sequence length without touching the shared preset.
    """
    if flavor not in spec.flavors:
        raise ValueError(f"unknown flavor {flavor!r} for model {spec.name!r}; valid flavors: {', '.join(spec.flavors)}")
    args = spec.flavors[flavor]
    valid_fields = {f.name for f in dataclasses.fields(args)}
    unknown = sorted(set(overrides) - valid_fields)
    if unknown:
        raise ValueError(
            f"unknown argument(s) {', '.join(unknown)} for model {spec.name!r}; "
            f"valid: {', '.join(sorted(valid_fields))}"
        )
    return dataclasses.replace(args, **overrides)
