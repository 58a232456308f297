"""The transformers backend's Hugging Face adapter: the checkpoint's own names, nearly unchanged.

Inside a layer every name is Hugging Face's already (``layers.3.self_attn.q_proj.weight`` is
``model.layers.3.self_attn.q_proj.weight``); only the parts the shared decoder's interface names are renamed:
``tok_embeddings`` / ``norm`` (``model.embed_tokens`` / ``model.norm``), ``output`` (``lm_head``), and any other
child of the base model (``model.<name>``). No RoPE permutation: the model computes RoPE as its checkpoints store
it. ``config.json`` goes through untouched, so an export writes the file the run started from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from titanium.models.hf_adapter import HFAdapter, HFConfigError
from titanium.models.transformers.args import BackendConfigError, TransformersArgs

BASE_PREFIX = "model."
_OURS_TO_HF = {"tok_embeddings.": "model.embed_tokens.", "norm.": "model.norm.", "output.": "lm_head."}


@dataclasses.dataclass(frozen=True)
class TransformersHFAdapter(HFAdapter):
    """``config.json`` <-> ``TransformersArgs``, and the few renames of the module docstring."""

    code_folder: str | None = None
    """Where a ``config.json`` naming its own modeling code (``auto_map``) may take it from ([model]
    trust_remote_code); None: only ``transformers``' own code. Set per job (``with_code_from``)."""

    def with_code_from(self, folder: str | None) -> TransformersHFAdapter:
        return dataclasses.replace(self, code_folder=folder)

    def reads(self, model_type: object) -> bool:
        return True  # (whether transformers knows it is for args.hf_config to say)

    def hf_key(self, key: str) -> str:
        for ours, hf in _OURS_TO_HF.items():
            if key.startswith(ours):
                return hf + key.removeprefix(ours)
        return BASE_PREFIX + key

    def _our_key_and_expert(self, hf_key: str) -> tuple[str, int | None] | None:
        for ours, hf in _OURS_TO_HF.items():
            if hf_key.startswith(hf):
                return ours + hf_key.removeprefix(hf), None
        if hf_key.startswith(BASE_PREFIX):
            return hf_key.removeprefix(BASE_PREFIX), None
        return None

    # ----- config.json -----

    def from_hf_config(self, config: Mapping[str, Any], **overrides: Any) -> TransformersArgs:
        try:
            args = TransformersArgs.from_config(config, code_folder=self.code_folder, **overrides)
            args.hf_config  # noqa: B018 (read now, so a config transformers refuses fails here, with its file named)
        except BackendConfigError as e:
            raise HFConfigError(str(e)) from None
        return args

    def to_hf_config(self, args: TransformersArgs) -> dict[str, Any]:
        return dict(args.config)

    def config_fields(self, args: Any) -> dict[str, tuple[str, Any]]:
        return {}  # (no flavors to compare a checkpoint with: the checkpoint is the architecture)

    def unsupported(self, config: Mapping[str, Any]) -> list[str]:
        return []


def checkpoint_conversions(model_type: str) -> list[str]:
    """The tensor conversions ``transformers`` applies between the checkpoints of ``model_type`` and its modules
    (an MoE's per-expert tensors stacked in memory), as their source patterns; empty where the checkpoint holds the
    modules' own tensors. The backend reads and writes checkpoints name for name, so it cannot apply them yet."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    converters = [c for c in get_checkpoint_conversion_mapping(model_type) or [] if isinstance(c, WeightConverter)]
    return sorted({pattern for c in converters for pattern in c.source_patterns})


TRANSFORMERS_HF_ADAPTER = TransformersHFAdapter(model_type="", layer_keys={}, top_keys={})
"""The backend's adapter (``model_type`` "": ``hf_family`` never picks the backend for a ``model_type``)."""

__all__ = ["TRANSFORMERS_HF_ADAPTER", "TransformersHFAdapter"]
