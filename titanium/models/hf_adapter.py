"""Hugging Face state-dict adapters: names, RoPE layout and ``config.json`` of a model family.

An adapter is pure tensor and dict code (no files, no ``torch.distributed``): the checkpoint layer
(``titanium.checkpoint.hf``) reads and writes the safetensors and uses an adapter to translate.
Each family describes itself with a few tables (``layer_keys``, ``top_keys``, ``rope_keys``, and for MoE
models ``expert_keys`` and ``no_hf_slot``) and its ``config.json`` mapping; the renaming, the RoPE permutation,
the per-expert split of stacked expert weights and the tied-embedding rules live here once.

RoPE layout: titanium rotates interleaved pairs ``(x[2i], x[2i+1])`` (Meta's convention), Hugging
Face rotates halves ``(x[i], x[i + D/2])``. Both compute the same attention if the output rows of
``wq``/``wk`` (and of any per-head weight applied before RoPE, such as Qwen3's ``q_norm``/``k_norm``)
are permuted within each head: our row ``2i + j`` is HF row ``j * D/2 + i``.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from titanium.errors import UserError
from titanium.models.common.rope import RopeScaling


class HFConfigError(UserError, ValueError):
    """A ``config.json`` that does not describe the configured model; the message lists the fields."""


class HFExportError(UserError, ValueError):
    """Model state that the family's Hugging Face format cannot hold; the message names it and the way out."""


def rope_rows_to_hf(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Permute the rows of a per-head weight (``[n_heads * head_dim, ...]``) from interleaved to halves."""
    rest = weight.shape[1:]
    return weight.reshape(-1, head_dim // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


def rope_rows_from_hf(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of ``rope_rows_to_hf``: HF rotate-half rows back to interleaved pairs."""
    rest = weight.shape[1:]
    return weight.reshape(-1, 2, head_dim // 2, *rest).transpose(1, 2).reshape(weight.shape)


@dataclass(frozen=True)
class RowSource:
    """Where one of our (non-expert) tensors lies in a Hugging Face tensor: the rows from ``offset`` on of ``key``
    (a fused tensor such as Phi-3's ``qkv_proj`` holds several of ours, one after the other), with the rows of
    each head of ``rope_head_dim`` rows in HF's RoPE order when set. Every column is ours."""

    key: str
    offset: int = 0
    rope_head_dim: int | None = None
    transposed: bool = False
    """Ours, stacked experts ``[E, rows, cols]``, is ``key`` ``[E, cols, ...]`` with its last two dimensions swapped
    (experts that multiply from the left, Llama 4's), ``offset`` counting along the last: every other case counts
    rows."""


_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def split_layer_key(key: str) -> tuple[str, str] | None:
    """``layers.3.attention.wq.weight`` -> ``("3", "attention.wq.weight")``; None outside the blocks."""
    match = _OURS_LAYER.match(key)
    return None if match is None else (match.group(1), match.group(2))


def scaling_to_hf(scaling: RopeScaling | None) -> dict[str, Any] | None:
    if scaling is None:
        return None
    return {
        "rope_type": "llama3",
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
    }


@dataclass(frozen=True)
class HFAdapter:
    """Translate one model family between titanium and Hugging Face ``transformers``.

    Subclasses fill the tables and implement the ``config.json`` mapping:

    - ``layer_keys``: per-block names, ours -> HF, relative to ``layers.N.`` / ``model.layers.N.``.
    - ``top_keys``: the remaining names, ours -> HF (embeddings, final norm, output projection).
    - ``rope_keys``: per-block names (ours) whose rows are in RoPE layout and get permuted.
    - ``output_key``: our output projection, absent from HF checkpoints when embeddings are tied.
    - ``expert_keys``: per-block stacked expert weights (ours, ``[num_experts, ...]``) that HF stores as one
      tensor per expert: ours -> the HF name with ``{e}`` for the expert, or a tuple of such names whose tensors,
      of equal row counts and concatenated along their rows in that order, are one expert's (``transformers``' fused
      ``gate_up_proj``: the gate projection's rows, then the up projection's). Stacked on load, split on export.
    - ``no_hf_slot``: per-block state the HF format has no place for (an MoE's routing bias). Loading leaves
      it at its initial zeros; exporting skips it while it is zero and refuses it otherwise, since dropping
      it would change what the model computes.
    - ``memory_expert_params``: how ``transformers`` holds the experts *in memory* (where PEFT adapts them), which
      is not the checkpoint's per-expert layout: per-block stacked expert weight (ours) -> (the HF module's
      stacked parameter, the index of our part among those it concatenates along its rows), listed in the order the
      HF module declares its parameters (PEFT wraps them in that order).
    """

    model_type: str
    """``model_type`` in ``config.json`` (``llama``, ``qwen3``)."""
    layer_keys: Mapping[str, str]
    top_keys: Mapping[str, str]
    rope_keys: frozenset[str] = frozenset()
    embedding_key: str = "tok_embeddings.weight"
    output_key: str = "output.weight"
    expert_keys: Mapping[str, str | tuple[str, ...]] = field(default_factory=dict)
    no_hf_slot: frozenset[str] = frozenset()
    memory_expert_params: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    _from_hf: dict[str, str] = field(init=False, repr=False, compare=False)
    _hf_layer: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _hf_expert: list[tuple[str, int, re.Pattern[str]]] = field(init=False, repr=False, compare=False)
    """Per HF tensor of one expert: (our stacked weight, which of its ``expert_keys`` names, the name's pattern)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_from_hf", {hf: ours for ours, hf in self.layer_keys.items()})
        object.__setattr__(self, "_hf_layer", re.compile(r"^model\.layers\.(\d+)\.(.+)$"))
        patterns = [
            (ours, part, re.compile("^" + re.escape(hf).replace(re.escape("{e}"), r"(\d+)") + "$"))
            for ours, names in self.expert_keys.items()
            for part, hf in enumerate(_names(names))
        ]
        object.__setattr__(self, "_hf_expert", patterns)

    def reads(self, model_type: object) -> bool:
        """Whether this adapter reads ``config.json`` files of ``model_type``."""
        return model_type == self.model_type

    # ----- names -----

    def hf_key(self, key: str) -> str:
        """Our parameter name -> the Hugging Face name; ``KeyError`` for a name the family lacks."""
        match = _OURS_LAYER.match(key)
        if match and match.group(2) in self.layer_keys:
            return f"model.layers.{match.group(1)}.{self.layer_keys[match.group(2)]}"
        if key in self.top_keys:
            return self.top_keys[key]
        raise KeyError(f"{key!r} has no Hugging Face name in the {self.model_type} adapter")

    def module_key(self, hf_key: str) -> str:
        """The name in ``transformers``' model in memory (what PEFT adapters name) of the checkpoint's ``hf_key``: the
        same, unless the checkpoint keeps an older layout that ``transformers`` renames on loading."""
        return hf_key

    def our_key(self, hf_key: str) -> str | None:
        """Hugging Face name -> ours (for one expert's tensor: the stacked weight); None for a name this family
        does not know."""
        return None if (found := self._our_key_and_expert(hf_key)) is None else found[0]

    def _our_key_and_expert(self, hf_key: str) -> tuple[str, tuple[int, int] | None] | None:
        """Our name of ``hf_key``, and for one expert's tensor (``expert_keys``) which expert and which of the tensors
        that make that expert's part of ours."""
        match = self._hf_layer.match(hf_key)
        if match:
            layer, rest = match.groups()
            if rest in self._from_hf:
                return f"layers.{layer}.{self._from_hf[rest]}", None
            for ours, part, pattern in self._hf_expert:
                if expert := pattern.match(rest):
                    return f"layers.{layer}.{ours}", (int(expert.group(1)), part)
            return None
        for ours, hf in self.top_keys.items():
            if hf == hf_key:
                return ours, None
        return None

    def _layer_part(self, key: str) -> tuple[str, str] | None:
        """``(layer number, name within the block)`` of one of our per-block names."""
        match = _OURS_LAYER.match(key)
        return (match.group(1), match.group(2)) if match else None

    def _is_rope(self, key: str) -> bool:
        part = self._layer_part(key)
        return part is not None and part[1] in self.rope_keys

    def has_hf_slot(self, key: str) -> bool:
        """Whether our ``key`` is stored in HF checkpoints (tied output matrices count: as the embedding)."""
        part = self._layer_part(key)
        return part is None or part[1] not in self.no_hf_slot

    def expert_templates(self, key: str) -> tuple[str, ...] | None:
        """For one of our stacked expert weights, the HF names of one expert's tensors with ``{e}`` for the expert
        (``model.layers.3.mlp.experts.{e}.gate_proj.weight``), whose rows, concatenated in this order in equal
        parts, are that expert's part of ours (most often one name); None for every other name."""
        part = self._layer_part(key)
        if part is None or part[1] not in self.expert_keys:
            return None
        return tuple(f"model.layers.{part[0]}.{name}" for name in _names(self.expert_keys[part[1]]))

    def hf_source(self, key: str, args: Any) -> RowSource:
        """Where our ``key`` (not a stacked expert weight: see ``expert_templates``) lies in the HF checkpoint, so a
        rank can read just the rows and columns of its shard; a tied output matrix reads the embedding."""
        if self.tied(args) and key == self.output_key:
            return RowSource(self.hf_key(self.embedding_key))
        return RowSource(self.hf_key(key), rope_head_dim=args.head_dim if self._is_rope(key) else None)

    def ignored_hf_keys(self, args: Any, ours: Collection[str]) -> set[str]:
        """Keys a checkpoint may hold that loading a model with the keys ``ours`` skips: a tied model's
        ``lm_head`` (some exporters store it anyway)."""
        return {self.hf_key(self.output_key)} if self.tied(args) and self.output_key in ours else set()

    def skips(self, hf_key: str, args: Any) -> bool:
        """Whether a checkpoint's tensor ``hf_key`` belongs to no part of the model, as ``transformers`` skips it on
        loading (DeepSeek-V3's multi-token-prediction layer): neither read, nor written to an export."""
        return False

    def hf_shapes(self, shapes: Mapping[str, tuple[int, ...]], args: Any) -> dict[str, tuple[int, ...]]:
        """The keys and shapes an HF checkpoint of a model with ``shapes`` (ours) holds: no ``lm_head`` when
        tied, one tensor per expert for stacked experts, nothing for state without an HF slot."""
        out: dict[str, tuple[int, ...]] = {}
        for key, shape in shapes.items():
            if (self.tied(args) and key == self.output_key) or not self.has_hf_slot(key):
                continue
            templates = self.expert_templates(key)
            if templates is not None:
                rows, *rest = shape[1:]
                for template in templates:
                    out.update({template.format(e=e): (rows // len(templates), *rest) for e in range(shape[0])})
            else:
                out[self.hf_key(key)] = tuple(shape)
        return out

    # ----- tensors -----

    def exports_in_source_layout(self) -> bool:
        """Whether a model loaded from a checkpoint through this adapter is saved back in that checkpoint's layout
        (keys, files, config.json); False when the model is another kind than its source (a reward model started
        from a causal LM): it is then saved in this adapter's own layout and config."""
        return True

    def tied(self, args: Any) -> bool:
        return args.tie_word_embeddings

    def to_hf(self, state_dict: Mapping[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        """Our full state dict -> Hugging Face names and layout. Tied models drop the output matrix; stacked
        experts become one (copied) tensor per expert and part."""
        out: dict[str, torch.Tensor] = {}
        for key, value in state_dict.items():
            if self.tied(args) and key == self.output_key:
                continue
            if not self.has_hf_slot(key):
                if value.count_nonzero():
                    raise HFExportError(
                        f"{key} is not zero, and the {self.model_type} Hugging Face format has no slot for it: "
                        "exporting without it would change which experts the model routes tokens to. A model "
                        "trained with aux-loss-free balancing (--moe.load_balance bias) cannot be exported to "
                        f"{self.model_type}; train with --moe.load_balance aux_loss (or none) to export it"
                    )
                continue
            templates = self.expert_templates(key)
            if templates is not None:
                for e, expert in enumerate(value.unbind(0)):
                    parts = expert.chunk(len(templates), dim=0)
                    out.update({name.format(e=e): part.clone() for name, part in zip(templates, parts, strict=True)})
                continue
            if self._is_rope(key):
                value = rope_rows_to_hf(value, args.head_dim)
            out[self.hf_key(key)] = value
        return out

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        """Hugging Face state dict -> ours. Unknown names raise ``KeyError`` (callers validate first).

        Tied models: the output matrix is the embedding table (an ``lm_head.weight`` stored anyway
        by some exporters is ignored).
        """
        out: dict[str, torch.Tensor] = {}
        experts: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
        for hf_key, value in hf_state_dict.items():
            found = self._our_key_and_expert(hf_key)
            if found is None:
                raise KeyError(f"{hf_key!r} is not a {self.model_type} weight")
            key, expert = found
            if expert is not None:
                experts.setdefault(key, {})[expert] = value
                continue
            if self.tied(args) and key == self.output_key:
                continue
            if self._is_rope(key):
                value = rope_rows_from_hf(value, args.head_dim)
            out[key] = value
        for key, found in experts.items():
            parts = len(self.expert_templates(key) or ())
            count = len(found) // parts
            if sorted(found) != [(e, part) for e in range(count) for part in range(parts)]:
                raise KeyError(f"{key}: experts {sorted({e for e, _ in found})} are not 0..{count - 1}, each whole")
            out[key] = torch.stack([torch.cat([found[e, part] for part in range(parts)]) for e in range(count)])
        if self.tied(args) and self.embedding_key in out:
            out[self.output_key] = out[self.embedding_key]
        return out

    # ----- config.json -----

    def config_fields(self, args: Any) -> dict[str, tuple[str, Any]]:
        """The architecture as ``config.json`` states it: HF field -> (our field name, value).

        Used to say how a checkpoint differs from a flavor; ``vocab_size`` and the maximum length are
        left out on purpose (the vocabulary comes from the checkpoint, the length from training).
        Read from the family's decoder arguments, which every family here has.
        """
        d = args.decoder_args()
        return {
            "hidden_size": ("dim", d.dim),
            "num_hidden_layers": ("n_layers", d.n_layers),
            "num_attention_heads": ("n_heads", d.n_heads),
            "num_key_value_heads": ("n_kv_heads", d.n_kv_heads),
            "head_dim": ("head_dim", d.head_dim),
            "intermediate_size": ("ffn_dim", d.ffn_dim),
            "rms_norm_eps": ("norm_eps", d.norm_eps),
            "rope_theta": ("rope_theta", d.rope_theta),
            "rope_scaling": ("rope_scaling", scaling_to_hf(d.rope_scaling)),
            "tie_word_embeddings": ("tie_word_embeddings", d.tie_word_embeddings),
        }

    def from_hf_config(self, config: Mapping[str, Any], **overrides: Any) -> Any:
        """Model args for a Hugging Face ``config.json`` (a dict); ``overrides`` replace fields."""
        raise NotImplementedError

    def to_hf_config(self, args: Any) -> dict[str, Any]:
        """A ``config.json`` dict that ``transformers`` loads as this architecture."""
        raise NotImplementedError

    def differences(self, config: Mapping[str, Any], args: Any) -> list[str]:
        """The architecture fields of ``config`` that differ from ``args``, e.g. ``hidden_size 128 != dim 256``."""
        return [
            f"{hf_name} {actual!r} != {our_name} {expected!r}"
            for hf_name, (our_name, expected) in self.config_fields(args).items()
            if not _same(actual := hf_config_value(config, hf_name), expected)
        ]

    def unsupported(self, config: Mapping[str, Any]) -> list[str]:
        """Features in ``config`` that this implementation does not have (each one a message)."""
        problems = []
        if config.get("model_type") != self.model_type:
            problems.append(f"model_type {config.get('model_type')!r} != {self.model_type!r}")
        for name in ("attention_bias", "mlp_bias"):
            if config.get(name):
                problems.append(f"{name} = true is not supported")
        act = config.get("hidden_act", "silu")
        if act != "silu":
            problems.append(f"hidden_act {act!r} is not supported (SwiGLU needs 'silu')")
        return problems


def rope_config(config: Mapping[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    """``(rope_theta, scaling)`` from a ``config.json`` of either transformers 4 or 5.

    transformers 4 writes ``rope_theta`` and ``rope_scaling``; 5 writes one ``rope_parameters`` dict
    that also holds the theta. ``scaling`` is None for plain RoPE (``rope_type`` "default").
    """
    params = config.get("rope_parameters")
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", config.get("rope_theta"))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = config.get("rope_theta")
        scaling = dict(config["rope_scaling"]) if config.get("rope_scaling") else None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
        else:
            scaling = {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": kind}
    return (None if theta is None else float(theta)), scaling


def hf_config_value(config: Mapping[str, Any], name: str) -> Any:
    """``config[name]`` with the transformers 4/5 differences smoothed over (RoPE keys, head_dim, experts)."""
    if name == "rope_theta":
        return rope_config(config)[0]
    if name == "rope_scaling":
        return rope_config(config)[1]
    if name == "head_dim" and config.get("head_dim") is None and "hidden_size" in config:
        return config["hidden_size"] // config["num_attention_heads"]
    if name == "num_key_value_heads" and config.get(name) is None:
        return config.get("num_attention_heads")
    if name == "tie_word_embeddings":
        return bool(config.get(name, False))
    if name == "num_experts" and name not in config:  # transformers 5 writes the MoE count as num_local_experts
        return config.get("num_local_experts")
    return config.get(name)


def _names(templates: str | tuple[str, ...]) -> tuple[str, ...]:
    """An ``expert_keys`` value as its tuple of names."""
    return (templates,) if isinstance(templates, str) else templates


def _same(actual: Any, expected: Any) -> bool:
    if isinstance(expected, float) and isinstance(actual, (int, float)) and not isinstance(actual, bool):
        return abs(actual - expected) <= 1e-9 * max(1.0, abs(expected))
    if isinstance(expected, dict) and isinstance(actual, Mapping):
        return set(expected) == set(actual) and all(_same(actual[k], v) for k, v in expected.items())
    return actual == expected
