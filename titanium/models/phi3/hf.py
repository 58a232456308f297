"""Phi-3 / Phi-4 <-> Hugging Face ``Phi3ForCausalLM``: Llama's weights, two of them fused in the checkpoint.

Phi-3 stores each block's query, key and value projections as one ``qkv_proj`` (rows: queries, keys, values)
and the SwiGLU gate and up projections as one ``gate_up_proj`` (rows: gate, then up). titanium keeps them apart
(so tensor parallelism shards whole heads and LoRA targets each projection): loading splits the fused tensors
by the model's head counts and widths, saving concatenates them again, so the round trip is exact. The q/k
rows get the RoPE permutation before fusing, as Llama's ``wq``/``wk`` do. Saving some parts alone (a LoRA
``B`` of ``wq`` only, for a PEFT adapter) fills the other parts' rows with zeros.

LongRoPE (``rope_scaling`` of type ``longrope``/``su``, the 128k-context variants) and partial rotary
embeddings (Phi-4-mini) are refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from titanium.models.common.decoder import DecoderArgs
from titanium.models.hf_adapter import RowSource, rope_config, rope_rows_from_hf, rope_rows_to_hf, split_layer_key
from titanium.models.llama3.hf import LLAMA_LAYER_KEYS, LLAMA_TOP_KEYS, ROPE_PROJECTIONS
from titanium.models.mistral.hf import WindowedHFAdapter

FUSED = {
    "self_attn.qkv_proj.weight": ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight"),
    "mlp.gate_up_proj.weight": ("feed_forward.w1.weight", "feed_forward.w3.weight"),
}
"""HF fused tensor -> our tensors, in row order."""
_PART_OF = {part: hf for hf, parts in FUSED.items() for part in parts}


def _split_sizes(args: DecoderArgs, hf: str) -> list[int]:
    if hf == "self_attn.qkv_proj.weight":
        q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        return [q, kv, kv]
    return [args.ffn_dim, args.ffn_dim]


def _fused_name(hf: str) -> tuple[str, str] | None:
    """``model.layers.3.self_attn.qkv_proj.weight`` -> ``("3", "self_attn.qkv_proj.weight")``; None if not fused."""
    parts = hf.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in FUSED:
        return parts[2], parts[3]
    return None


@dataclasses.dataclass(frozen=True)
class Phi3HFAdapter(WindowedHFAdapter):
    def hf_key(self, key: str) -> str:
        """A part of a fused tensor is named by the tensor that holds it."""
        layer = split_layer_key(key)
        if layer is not None and layer[1] in _PART_OF:
            return f"model.layers.{layer[0]}.{_PART_OF[layer[1]]}"
        return super().hf_key(key)

    def hf_source(self, key: str, args: Any) -> RowSource:
        """A part of a fused tensor is rows of it, after the parts before it."""
        layer = split_layer_key(key)
        if layer is None or layer[1] not in _PART_OF:
            return super().hf_source(key, args)
        fused = _PART_OF[layer[1]]
        offset = sum(_split_sizes(args, fused)[: FUSED[fused].index(layer[1])])
        rope = args.head_dim if layer[1] in self.rope_keys else None
        return RowSource(f"model.layers.{layer[0]}.{fused}", offset, rope)

    def to_hf(self, state_dict: Mapping[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        parts: dict[str, dict[str, torch.Tensor]] = {}  # HF fused key -> our part -> tensor
        rest = {}
        for key, value in state_dict.items():
            layer = split_layer_key(key)
            if layer is not None and layer[1] in _PART_OF:
                if layer[1] in self.rope_keys:
                    value = rope_rows_to_hf(value, args.head_dim)
                parts.setdefault(self.hf_key(key), {})[layer[1]] = value
            else:
                rest[key] = value
        out = super().to_hf(rest, args)
        for hf, tensors in parts.items():
            name = hf.split(".", 3)[3]  # (model.layers.N.<name>)
            like = next(iter(tensors.values()))  # a part absent here (a LoRA B of wq alone) is rows of zeros
            pieces = [
                tensors[part] if part in tensors else like.new_zeros(size, *like.shape[1:])
                for part, size in zip(FUSED[name], _split_sizes(args, name), strict=True)
            ]
            out[hf] = torch.cat(pieces)
        return out

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        fused = {hf: _fused_name(hf) for hf in hf_state_dict}
        out = super().from_hf({hf: v for hf, v in hf_state_dict.items() if fused[hf] is None}, args)
        for hf, value in hf_state_dict.items():
            if (layer_name := fused[hf]) is None:
                continue
            layer, name = layer_name
            for part, piece in zip(FUSED[name], value.split(_split_sizes(args, name)), strict=True):
                if part in self.rope_keys:
                    piece = rope_rows_from_hf(piece, args.head_dim)
                out[f"layers.{layer}.{part}"] = piece
        return out

    def unsupported(self, config: Mapping[str, Any]) -> list[str]:
        problems = [p for p in super().unsupported(config) if not p.startswith("rope_scaling")]
        scaling = rope_config(config)[1] or {}
        if scaling.get("rope_type") in ("longrope", "su", "yarn"):
            problems.append(
                f"rope_scaling type {scaling['rope_type']!r} (LongRoPE, the 128k-context Phi-3 variants) is not "
                "supported; use a 4k-context variant"
            )
        elif scaling:
            problems.append(f"rope_scaling {scaling} is not supported (plain RoPE only)")
        params = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), Mapping) else {}
        factor = config.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
        if factor != 1.0:
            problems.append(f"partial_rotary_factor {factor} is not supported (RoPE on the whole head only)")
        return problems

    def config_from_args(self, args: DecoderArgs) -> dict[str, Any]:
        return {
            **super().config_from_args(args),
            "original_max_position_embeddings": args.max_seq_len,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "pad_token_id": None,  # (transformers' default, 32000, is outside a small vocabulary)
        }


PHI3_LAYER_KEYS = {ours: hf for ours, hf in LLAMA_LAYER_KEYS.items() if ours not in _PART_OF}

PHI3_HF_ADAPTER = Phi3HFAdapter(
    model_type="phi3",
    layer_keys=PHI3_LAYER_KEYS,
    top_keys=LLAMA_TOP_KEYS,
    rope_keys=ROPE_PROJECTIONS,
    architecture="Phi3ForCausalLM",
    defaults={"rope_theta": 10_000.0, "norm_eps": 1e-5, "max_seq_len": 4096},
)
