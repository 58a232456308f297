"""The args of a model built by the transformers backend: its ``config.json``, and what titanium adds to it.

A native family describes its shapes with a dataclass of its own; a backend model is whatever ``config.json``
says, so its args carry that file's text and read the few numbers the rest of titanium needs (layers, vocabulary,
tied embeddings, heads for the layout checks) from the ``transformers`` config class, which fills in the
architecture's defaults. ``transformers`` is imported only when a config is first read (it is slow to import).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from collections.abc import Mapping
from functools import cached_property
from typing import Any

import torch

from titanium.models.common.decoder import DecoderArgs
from titanium.models.common.moe import MoEArgs


class BackendConfigError(ValueError):
    """A ``config.json`` the transformers backend cannot build (the checkpoint layer adds the file's name)."""


@dataclasses.dataclass(frozen=True)
class TransformersArgs:
    """A Hugging Face causal language model as the transformers backend builds it."""

    config_json: str
    """The model's ``config.json``, as canonical JSON text (hashable, and its repr names the model exactly)."""
    max_seq_len: int = 0
    """The largest position titanium feeds it (training's ``seq_len``); 0: the config's
    ``max_position_embeddings``."""
    code_folder: str | None = None
    """The folder whose own modeling code (``auto_map`` in ``config.json``) may run: set only with ``[model]
    trust_remote_code``; None: only the code that ships with ``transformers`` runs."""
    n_layers: int = 0
    """Decoder layers: 0 means the config's ``num_hidden_layers``; fewer builds the model cut to its first
    ``n_layers`` (the memory estimate traces such a model)."""
    score_head: bool = False
    """The model ends in a scalar score head instead of its LM head (a reward or value model: ``use_score_head``),
    never tied to the embedding."""

    def __post_init__(self) -> None:
        if not self.max_seq_len:
            object.__setattr__(self, "max_seq_len", int(self.config.get("max_position_embeddings") or 2048))
        if not self.n_layers:  # (the config class knows the field under its other names: GPT-2's n_layer)
            layers = self.config.get("num_hidden_layers") or getattr(self.text_config, "num_hidden_layers", None)
            if not isinstance(layers, int):
                raise BackendConfigError(
                    f"{type(self.hf_config).__name__} names no decoder layer count (num_hidden_layers): not a causal "
                    "language model the transformers backend can build"
                )
            object.__setattr__(self, "n_layers", layers)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], **fields: Any) -> TransformersArgs:
        """The args of ``config``, without its ``quantization_config``: titanium builds, trains and exports the weights
        a quantized checkpoint stands for (``titanium/checkpoint/hf_quantized.py`` reads them)."""
        plain = {key: value for key, value in config.items() if key != "quantization_config"}
        return cls(config_json=json.dumps(plain, sort_keys=True), **fields)

    @cached_property
    def config(self) -> dict[str, Any]:
        """``config.json`` as a dict."""
        return json.loads(self.config_json)

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type"))

    @cached_property
    def hf_config(self) -> Any:
        """The ``transformers`` config object (``PreTrainedConfig``), the architecture's defaults filled in.
        ``BackendConfigError`` for a ``model_type`` the installed ``transformers`` does not know (unless its own
        code may run) or values the config class refuses."""
        config = load_hf_config(self.config, self.code_folder)
        text = config.get_text_config()
        if self.n_layers and self.n_layers != text.num_hidden_layers:
            text.num_hidden_layers = self.n_layers
            if isinstance(getattr(text, "layer_types", None), list):
                text.layer_types = text.layer_types[: self.n_layers]
        return config

    @property
    def text_config(self) -> Any:
        """The language model's config: ``hf_config`` itself, or its ``text_config`` for an image-text model."""
        return self.hf_config.get_text_config()

    @property
    def reads_images(self) -> bool:
        """An image-text-to-text model (a vision tower beside the language model: Qwen2.5-VL, Llama 3.2 Vision,
        Gemma 3, Llama 4), built by ``vision.py``; its batches may carry images."""
        return is_image_text(self.config)

    @property
    def vocab_size(self) -> int:
        return int(self.text_config.vocab_size)

    @property
    def tie_word_embeddings(self) -> bool:  # (transformers ties by the outer config)
        return not self.score_head and bool(getattr(self.hf_config, "tie_word_embeddings", False))

    def decoder_args(self) -> DecoderArgs:
        """The shapes the layout checks read (heads against the tensor-parallel degree, layers against the pipeline,
        sliding windows against context parallelism), in the shared decoder's terms. Not an architecture: the
        model is built from ``config.json`` by ``transformers``."""
        c = self.text_config
        moe, moe_layers = routed_moe(self)
        n_heads = int(c.num_attention_heads)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // n_heads
        layer_types = list(getattr(c, "layer_types", None) or [])
        window = getattr(c, "sliding_window", None)
        if layer_types:
            global_layers = tuple(i for i, kind in enumerate(layer_types) if kind != "sliding_attention")
            window = window if len(global_layers) < len(layer_types) else None
        else:
            global_layers = ()
        return DecoderArgs(
            dim=int(c.hidden_size),
            n_layers=self.n_layers,
            n_heads=n_heads,
            n_kv_heads=int(getattr(c, "num_key_value_heads", None) or n_heads),
            head_dim=int(head_dim) + int(head_dim) % 2,  # (RoPE-free heads may be odd; the checks need no RoPE)
            ffn_dim=int(getattr(c, "intermediate_size", None) or c.hidden_size),
            vocab_size=self.vocab_size,
            norm_eps=1e-6,
            rope_theta=10000.0,
            max_seq_len=self.max_seq_len,
            tie_word_embeddings=self.tie_word_embeddings,
            sliding_window=int(window) if window else None,
            global_layers=global_layers,
            moe=moe,
            moe_layers=moe_layers,
        )

    @property
    def router_aux_loss_coef(self) -> float | None:
        """The weight of the auxiliary load-balancing loss the model was trained with (``[moe] aux_loss_coef``'s
        default), where ``config.json`` states one."""
        value = getattr(self.text_config, "router_aux_loss_coef", None)  # (an image-text model's: its language model's)
        return None if value is None else float(value)


def load_hf_config(config: Mapping[str, Any], code_folder: str | None = None) -> Any:
    """``config`` (a ``config.json`` dict) as its ``transformers`` config class; with ``code_folder``, a config
    class of the folder's own code (``auto_map``) may be used."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config.get("model_type")
    values = {k: v for k, v in config.items() if k not in ("transformers_version",)}
    if code_folder is not None and "auto_map" in config:
        return AutoConfig.from_pretrained(code_folder, trust_remote_code=True)
    if model_type not in CONFIG_MAPPING:
        known = "auto_map" in config
        raise BackendConfigError(
            f"model_type {model_type!r} is not known to the installed transformers"
            + (
                "; config.json names modeling code of its own (auto_map): to run that code, set "
                "--model.trust_remote_code (only for a folder whose code you trust)"
                if known
                else " (is it a newer architecture? a newer transformers may know it)"
            )
        )
    try:
        loaded = CONFIG_MAPPING[model_type].from_dict(values)
    except (TypeError, ValueError, KeyError) as e:
        raise BackendConfigError(f"transformers refuses it: {e}") from None
    text = loaded.get_text_config()
    if text is not loaded and not is_image_text(config):
        raise BackendConfigError(
            f"model_type {model_type!r} is a composite model ({type(loaded).__name__}: its language model is the "
            f"sub-config of model_type {text.model_type!r}); the transformers backend trains causal language models "
            "alone, or image-text-to-text models (docs/vision.md): start from a text-only checkpoint of it"
        )
    return loaded


@functools.lru_cache(maxsize=16)
def routed_moe(args: TransformersArgs) -> tuple[MoEArgs | None, frozenset[int]]:
    """The ``MoEArgs`` of the blocks titanium's MoE computes in the model of ``args`` and their layers (``moe.py``),
    from ``transformers``' model of it built on meta (cached): what the layout checks, the dry run and the
    checkpoint mapping know of its MoE before the model exists (``TransformersModel`` swaps the same blocks)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from titanium.models.transformers.moe import swap_moe_blocks

    trust = args.code_folder is not None
    with torch.device("meta"):
        config = copy.deepcopy(args.hf_config)
        if args.reads_images:
            from titanium.models.transformers.language import language_model

            base = language_model(AutoModelForImageTextToText.from_config(config, dtype=torch.float32))
        else:
            base = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust).base_model
    if not isinstance(getattr(base, "layers", None), torch.nn.ModuleList):
        return None, frozenset()  # (a layout the backend refuses when it builds the model: ``check_structure``)
    return swap_moe_blocks(base, args.model_type)


def is_image_text(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` (a ``config.json`` dict) is an image-text-to-text model's: ``transformers`` maps its
    ``model_type`` to an image-text-to-text class, and its config class has a vision sub-config."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    model_type = config.get("model_type")
    if model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES or model_type not in CONFIG_MAPPING:
        return False
    return "vision_config" in getattr(CONFIG_MAPPING[model_type], "sub_configs", {})
