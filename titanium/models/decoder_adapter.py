"""The Hugging Face adapter of a family whose args are the shared ``DecoderArgs`` (Qwen2, Mistral, Phi-3, Gemma 2).

Every such family's ``config.json`` states the shape alike (``hidden_size``, ``num_hidden_layers``, ...); what a
family adds are a few of its own fields (Qwen2's biases, Mistral's window, Gemma 2's soft-capping), which its
subclass maps in ``args_from_config`` / ``config_from_args``, and the features it refuses (``unsupported``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from titanium.models.common.decoder import DecoderArgs
from titanium.models.hf_adapter import HFAdapter, HFConfigError, hf_config_value, rope_config


@dataclasses.dataclass(frozen=True)
class DecoderHFAdapter(HFAdapter):
    """``config.json`` <-> ``DecoderArgs``: the common fields here, the family's own in the two hooks below."""

    architecture: str = ""
    """``architectures[0]`` of the ``config.json`` written for a fresh model, e.g. ``Qwen2ForCausalLM``."""
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """``rope_theta``, ``norm_eps``, ``max_seq_len`` and optionally ``tie_word_embeddings`` (else False) for a
    ``config.json`` that leaves them out (as ``transformers`` reads the same file)."""

    def args_from_config(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The family's own ``DecoderArgs`` fields, read from ``config`` (already checked by ``unsupported``)."""
        return {}

    def config_from_args(self, args: DecoderArgs) -> dict[str, Any]:
        """The family's own ``config.json`` fields for ``args``."""
        return {}

    def unsupported(self, config: Mapping[str, Any]) -> list[str]:
        problems = super().unsupported(config)
        scaling = rope_config(config)[1]
        if scaling is not None:
            problems.append(f"rope_scaling {scaling} is not supported (plain RoPE only)")
        return problems

    def from_hf_config(self, config: Mapping[str, Any], **overrides: Any) -> DecoderArgs:
        problems = self.unsupported(config)
        if problems:
            raise HFConfigError("; ".join(problems))
        args = DecoderArgs(**decoder_fields(config, self.defaults), **self.args_from_config(config))
        return dataclasses.replace(args, **overrides)

    def to_hf_config(self, args: DecoderArgs) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            **decoder_config(args),
            **self.config_from_args(args),
        }


def decoder_fields(config: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The shape fields (``DecoderArgs``' names) that every family's ``config.json`` states alike; ``defaults``
    (``rope_theta``, ``norm_eps``, ``max_seq_len``, optionally ``tie_word_embeddings``) fill what it leaves out.
    ``KeyError`` names a missing shape field."""
    theta = rope_config(config)[0]
    return {
        "dim": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "n_heads": config["num_attention_heads"],
        "n_kv_heads": hf_config_value(config, "num_key_value_heads"),
        "head_dim": hf_config_value(config, "head_dim"),
        "ffn_dim": config["intermediate_size"],
        "vocab_size": config["vocab_size"],
        "norm_eps": float(config.get("rms_norm_eps", defaults["norm_eps"])),
        "rope_theta": defaults["rope_theta"] if theta is None else theta,
        "max_seq_len": config.get("max_position_embeddings", defaults["max_seq_len"]),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", defaults.get("tie_word_embeddings", False))),
    }


def decoder_config(args: DecoderArgs) -> dict[str, Any]:
    """The ``config.json`` fields every family writes alike for a fresh model (no RoPE scaling, no dropout)."""
    return {
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
