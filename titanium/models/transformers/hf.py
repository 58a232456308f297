"""The transformers backend's Hugging Face adapter: the checkpoint's own names, nearly unchanged.

Inside a layer every name is Hugging Face's already (``layers.3.self_attn.q_proj.weight`` is
``model.layers.3.self_attn.q_proj.weight``); only the parts the shared decoder's interface names are renamed, by
prefix: ``tok_embeddings`` / ``norm`` (``model.embed_tokens`` / ``model.norm``), ``output`` (``lm_head``), and any
other child of the base model (``model.<name>``). An image-text model's language model sits deeper
(``model.language_model.``) and its vision parts beside it (``model.visual.``): ``vision.py`` gives those prefixes, the
checkpoint's own where it keeps an older layout (``with_prefixes``). No RoPE permutation: the model computes RoPE as
its checkpoints store it. ``config.json`` goes through untouched, so an export writes the file the run started from.

One conversion is made: the MoE models whose checkpoints keep one tensor per expert and projection (written in
transformers 4's layout: DeepSeek-V3, Qwen3-MoE, Qwen2-MoE, Qwen3-Next, GLM-4.5, OLMoE, Mixtral, PhiMoE...), which
``transformers`` stacks on loading, are read and written per expert (``expert_tensors``, ``for_config``), as the
native Qwen3-MoE family reads them: into titanium's MoE where it computes their blocks, and where a block runs as
``transformers`` wrote it, into its stacked ``gate_up_proj`` (each expert's ``gate_proj`` rows, then its
``up_proj`` rows) and ``down_proj``. The names ``transformers`` renames on loading beside them (Mixtral's
``block_sparse_moe`` for ``mlp``, PhiMoE's router ``gate`` for ``router``) are renamed back in the checkpoint's names
(``renames``). Any other conversion ``transformers`` makes on loading is refused (``checks.py``); a prefix it would
strip (a text model's weights kept under an image-text model's ``model.language_model.``) is not, and such a
checkpoint is refused by its names when it is read.

Llama 4's checkpoints (no conversion: ``feed_forward.experts.gate_up_proj`` ``[E, H, 2I]`` and ``down_proj``
``[E, I, H]``, stacked as in memory) hold titanium's ``w1`` / ``w3`` / ``w2`` transposed (``moe.BlockNames``): each rank
reads the box of its shard and transposes it (``RowSource.transposed``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from typing import Any

import torch

from titanium.models.hf_adapter import HFAdapter, HFConfigError, HFExportError, RowSource, split_layer_key
from titanium.models.transformers.args import BackendConfigError, TransformersArgs, routed_moe
from titanium.models.transformers.moe import CORRECTION_BIAS, ROUTING, BlockNames, block_names, corrects_routing

Prefixes = tuple[tuple[str, str], ...]
"""Our names' prefixes -> the Hugging Face names', most specific first; "" (the rest) last."""
CAUSAL_LM_PREFIXES: Prefixes = (
    ("tok_embeddings.", "model.embed_tokens."),
    ("norm.", "model.norm."),
    ("output.", "lm_head."),
    ("", "model."),
)
HALVES = {"moe.experts.w1": 0, "moe.experts.w3": 1}
"""Our stacked expert weights (in a block) that are halves of ``gate_up_proj`` (``[E, 2I, H]``: gate rows first), by
half."""


def moe_to_hf(names: BlockNames) -> dict[str, str]:
    """Inside a layer whose MoE block titanium computes (``moe.py``): our name -> ``transformers``' in-memory name
    (``w1`` and ``w3``: the ``gate_up_proj`` they are halves of)."""
    b, router = names.block, names.router
    return {
        f"{b}.moe.router.gate.weight": f"{b}.{router}.weight",
        f"{b}.moe.experts.w1": f"{b}.experts.gate_up_proj",
        f"{b}.moe.experts.w3": f"{b}.experts.gate_up_proj",
        f"{b}.moe.experts.w2": f"{b}.experts.down_proj",
        f"{b}.moe.expert_bias": f"{b}.{router}.{CORRECTION_BIAS}",
    }


STACKED = {
    "mlp.experts.gate_up_proj": ("mlp.moe.experts.w1", "mlp.moe.experts.w3"),
    "mlp.experts.down_proj": ("mlp.moe.experts.w2",),
}
"""``transformers``' stacked expert weights in memory (a block that runs as it wrote it holds them) -> ours in a block
titanium's MoE computes, in the order of the per-expert tensors it concatenates into them (gate rows, then up
rows)."""


@dataclasses.dataclass(frozen=True)
class TransformersHFAdapter(HFAdapter):
    """``config.json`` <-> ``TransformersArgs``, and the few renames of the module docstring."""

    code_folder: str | None = None
    """Where a ``config.json`` naming its own modeling code (``auto_map``) may take it from ([model]
    trust_remote_code); None: only ``transformers``' own code. Set per job (``with_code_from``)."""
    prefixes: Prefixes = CAUSAL_LM_PREFIXES
    """The checkpoint's names of our parts (an image-text model's: ``vision.checkpoint_prefixes``)."""
    module_prefixes: Prefixes = CAUSAL_LM_PREFIXES
    """The names of the model in memory (``vision.module_prefixes``), which PEFT adapters use."""
    routing_bias: bool = False
    """Whether the checkpoint holds the routing bias of the blocks titanium's MoE computes (DeepSeek-V3's
    ``e_score_correction_bias``), so loading reads it (``for_config``)."""
    renames: tuple[tuple[str, str], ...] = ()
    """The checkpoint's name parts -> the model's in memory, as ``transformers`` renames them on loading
    (``(".block_sparse_moe.", ".mlp.")``); set with ``expert_keys`` (``for_config``)."""
    moe_blocks: BlockNames = BlockNames()
    """The names and layout of the model's MoE blocks (``moe.BLOCKS``: Llama 4's); set by ``for_config``."""

    def with_code_from(self, folder: str | None) -> TransformersHFAdapter:
        return dataclasses.replace(self, code_folder=folder)

    def with_prefixes(self, checkpoint: Prefixes, modules: Prefixes) -> TransformersHFAdapter:
        """This adapter for a model whose checkpoint names its parts by ``checkpoint`` (and memory by ``modules``)."""
        return dataclasses.replace(self, prefixes=checkpoint, module_prefixes=modules)

    def for_config(self, config: Mapping[str, Any]) -> TransformersHFAdapter:
        """This adapter for the checkpoints of the model of ``config`` (a ``config.json`` dict): per expert where they
        keep one tensor per expert (``expert_tensors``), into the blocks titanium's MoE computes (ours: ``w1``, ``w3``,
        ``w2``), with the routing bias where their routers have one (DeepSeek-V3's), or else into those that run as
        ``transformers`` wrote them (its stacked ``gate_up_proj``, two tensors per expert, and ``down_proj``)."""
        model_type = config.get("model_type")
        if self.prefixes != CAUSAL_LM_PREFIXES:  # (an image-text model: its checkpoint's experts are stacked)
            return dataclasses.replace(self, moe_blocks=block_names(str(model_type)))
        found = expert_tensors(model_type) if isinstance(model_type, str) else None
        if found is None:
            return self
        stacked, renames = found
        args = TransformersArgs.from_config(config) if model_type in ROUTING else None
        swapped = args is not None and bool(routed_moe(args)[1])  # (all of its MoE blocks or none)
        experts: dict[str, str | tuple[str, ...]] = {}
        for name, sources in stacked.items():
            names = tuple(_back(f"model.layers.0.{s}", renames).removeprefix("model.layers.0.") for s in sources)
            experts.update(zip(STACKED[name], names, strict=True) if swapped else {name: names})
        bias = args is not None and swapped and _correction_bias(args)
        return dataclasses.replace(self, expert_keys=experts, renames=renames, routing_bias=bias)

    def reads(self, model_type: object) -> bool:
        return True  # (whether transformers knows it is for args.hf_config to say)

    def hf_key(self, key: str) -> str:
        part = split_layer_key(key)
        names = moe_to_hf(self.moe_blocks)
        if part is not None and part[1] in names:
            key = f"layers.{part[0]}.{names[part[1]]}"
        return _back(_renamed(key, self.prefixes), self.renames)

    def hf_source(self, key: str, args: Any) -> RowSource:
        """Experts stored to multiply from the left (Llama 4's) hold ours transposed, ``w3`` after ``w1``."""
        part = split_layer_key(key)
        inner = None if part is None else part[1].removeprefix(f"{self.moe_blocks.block}.")
        if not self.moe_blocks.inputs_first or inner not in (*HALVES, "moe.experts.w2"):
            return super().hf_source(key, args)
        moe = routed_moe(args)[0]
        offset = moe.expert_dim if moe is not None and HALVES.get(inner) == 1 else 0
        return RowSource(self.hf_key(key), offset, transposed=True)

    def skips(self, hf_key: str, args: Any) -> bool:
        return any(re.search(pattern, hf_key) for pattern in skipped_patterns(args.model_type))

    def module_key(self, hf_key: str) -> str:
        ours = self.our_key(hf_key)
        return hf_key if ours is None else _renamed(ours, self.module_prefixes)

    def has_hf_slot(self, key: str) -> bool:
        # The routing bias has one (e_score_correction_bias) only in DeepSeek-V3's routers (``routing_bias``; a non-zero
        # bias elsewhere is refused by ``to_hf``).
        part = split_layer_key(key)
        return part is None or part[1] != f"{self.moe_blocks.block}.moe.expert_bias" or self.routing_bias

    def _our_key_and_expert(self, hf_key: str) -> tuple[str, tuple[int, int] | None] | None:
        found = super()._our_key_and_expert(hf_key)  # (one expert's tensor, where ``expert_keys`` lists them)
        if found is not None:
            return found
        hf_key = _forth(hf_key, self.renames)
        for ours, hf in sorted(self.prefixes, key=lambda pair: -len(pair[1])):
            if hf_key.startswith(hf):
                return ours + hf_key.removeprefix(hf), None
        return None

    # ----- tensors: titanium's MoE in swapped blocks -----

    def to_hf(self, state_dict: Mapping[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        block, transposed = f"{self.moe_blocks.block}.", self.moe_blocks.inputs_first
        halves: dict[str, dict[int, torch.Tensor]] = {}
        rest, out = {}, {}
        for key, value in state_dict.items():
            part = split_layer_key(key)
            inner = None if part is None else part[1].removeprefix(block)
            if inner in HALVES and not self.expert_keys:
                halves.setdefault(self.hf_key(key), {})[HALVES[inner]] = value
            elif transposed and inner == "moe.experts.w2":
                out[self.hf_key(key)] = value.transpose(1, 2)
            elif inner == "moe.expert_bias":
                if _correction_bias(args):
                    out[self.hf_key(key)] = value
                elif value.count_nonzero():
                    raise HFExportError(
                        f"{key} is not zero, and {args.model_type}'s router has no routing bias: exporting without it "
                        "would change which experts the model routes tokens to; train with --moe.load_balance aux_loss "
                        "(or none) to export it"
                    )
            else:
                rest[key] = value
        for hf_key, parts in halves.items():
            if sorted(parts) != [0, 1]:
                raise KeyError(f"{hf_key} needs both w1 and w3 of its layer")
            fused = torch.cat([parts[0], parts[1]], dim=1)
            out[hf_key] = fused.transpose(1, 2) if transposed else fused
        return {**super().to_hf(rest, args), **out}

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        swapped = routed_moe(args)[1]
        names, transposed = moe_to_hf(self.moe_blocks), self.moe_blocks.inputs_first
        gate_up = names[f"{self.moe_blocks.block}.moe.experts.w1"]
        to_ours = {hf: ours for ours, hf in names.items() if hf != gate_up}
        layers = re.compile(rf"^{re.escape(dict(self.prefixes)[''])}layers\.(\d+)\.(.+)$")
        rest, out = {}, {}
        for hf_key, value in hf_state_dict.items():
            match = layers.match(_forth(hf_key, self.renames))
            inside = match is not None and int(match.group(1)) in swapped
            ours = None if match is None else f"layers.{match.group(1)}.{self.moe_blocks.block}.moe.experts."
            if inside and match.group(2) == gate_up:
                out[f"{ours}w1"], out[f"{ours}w3"] = (value.transpose(1, 2) if transposed else value).chunk(2, dim=1)
            elif inside and match.group(2) in to_ours:
                down = transposed and to_ours[match.group(2)].endswith(".w2")
                out[f"layers.{match.group(1)}.{to_ours[match.group(2)]}"] = value.transpose(1, 2) if down else value
            else:
                rest[hf_key] = value
        return {**super().from_hf(rest, args), **out}

    # ----- config.json -----

    def from_hf_config(self, config: Mapping[str, Any], **overrides: Any) -> TransformersArgs:
        try:
            args = TransformersArgs.from_config(config, code_folder=self.code_folder, **overrides)
            args.hf_config  # noqa: B018 (read now, so a config transformers refuses fails here, with its file named)
        except BackendConfigError as e:
            raise HFConfigError(str(e)) from None
        return args

    def to_hf_config(self, args: TransformersArgs) -> dict[str, Any]:
        config = dict(args.config)
        if not config.get("architectures"):  # (a config.json written by hand: vLLM and exports pick the class by it)
            config["architectures"] = [model_class_name(args)]
        return config

    def config_fields(self, args: Any) -> dict[str, tuple[str, Any]]:
        return {}  # (no flavors to compare a checkpoint with: the checkpoint is the architecture)

    def unsupported(self, config: Mapping[str, Any]) -> list[str]:
        return []


def checkpoint_conversions(model_type: str) -> list[str]:
    """The tensor conversions ``transformers`` applies between the checkpoints of ``model_type`` and its modules
    (an MoE's per-expert tensors stacked in memory), as their source patterns; empty where the checkpoint holds the
    modules' own tensors. The backend reads and writes checkpoints name for name, and makes only the per-expert
    conversion (``unconverted``)."""
    from transformers.core_model_loading import WeightConverter

    return sorted(
        {p for c in _conversion_mapping(model_type) if isinstance(c, WeightConverter) for p in c.source_patterns}
    )


def unconverted(model_type: str) -> list[str]:
    """The conversions of ``checkpoint_conversions(model_type)`` the backend cannot make: none where they are the
    per-expert stacking of ``expert_tensors``, else all of them (with the renamed tensors)."""
    conversions = checkpoint_conversions(model_type)
    if not conversions or expert_tensors(model_type) is not None:
        return []
    from transformers.core_model_loading import WeightRenaming

    renamed = {p for c in _conversion_mapping(model_type) if isinstance(c, WeightRenaming) for p in c.source_patterns}
    return conversions + sorted(renamed)


def expert_tensors(model_type: str) -> tuple[dict[str, tuple[str, ...]], tuple[tuple[str, str], ...]] | None:
    """Where the checkpoints of ``model_type`` keep one tensor per expert that ``transformers`` stacks on loading
    (its conversion mapping): its stacked expert weight in memory (``STACKED``) -> the per-expert tensors it
    concatenates along their rows into each expert's part (``{e}``: the expert), named as in memory, and the renames
    ``transformers`` makes beside them (checkpoint name part -> memory name part). None where its conversions are
    anything else: a stacking of other tensors or operations, or a rename that is not of plain names. A prefix it
    strips (``PrefixChange``) is not a conversion of this checkpoint's names: it reads another model's."""
    from transformers.core_model_loading import (
        Concatenate,
        MergeModulelist,
        PrefixChange,
        WeightConverter,
        WeightRenaming,
    )

    experts, renames = {}, []
    for conversion in _conversion_mapping(model_type):
        sources, targets = list(conversion.source_patterns), list(conversion.target_patterns)
        if isinstance(conversion, PrefixChange):
            continue
        if isinstance(conversion, WeightRenaming) and not isinstance(conversion, WeightConverter):
            plain = [_literal(p) for p in sources + targets]
            if len(sources) != 1 or len(targets) != 1 or None in plain:
                return None
            renames.append((plain[0], plain[1]))
            continue
        target = next((name for name in STACKED if len(targets) == 1 and name.endswith(targets[0].lstrip("."))), None)
        operations = [(type(o), getattr(o, "dim", None)) for o in conversion.operations]
        expected = [(MergeModulelist, 0)] + ([(Concatenate, 1)] if len(sources) == 2 else [])
        if target is None or len(sources) != len(STACKED[target]) or operations != expected:
            return None
        layer_part = target.removesuffix(targets[0].lstrip(".")).rstrip(".")
        experts[target] = tuple(
            ((layer_part if source.startswith(".") else "") + source).replace("*", "{e}") for source in sources
        )
    return (experts, tuple(renames)) if experts else None


_PLAIN = re.compile(r"\.?\w+(?:\.\w+)*\.?")
"""A rename pattern that names plain name parts (``.block_sparse_moe.``, ``mlp\\.router\\.gate\\.weight``), whose
dots, escaped or not, are meant literally."""


def _literal(pattern: str) -> str | None:
    """``pattern`` as the literal name parts it matches, or None where it is more than plain names (``_PLAIN``)."""
    text = pattern.replace("\\.", ".")
    return text if _PLAIN.fullmatch(text) else None


def _forth(hf_key: str, renames: tuple[tuple[str, str], ...]) -> str:
    """A checkpoint's name as ``transformers`` names it in memory."""
    for checkpoint, memory in renames:
        hf_key = hf_key.replace(checkpoint, memory)
    return hf_key


def _back(key: str, renames: tuple[tuple[str, str], ...]) -> str:
    """A name in memory as the checkpoint names it (``_forth`` undone, last rename first)."""
    for checkpoint, memory in reversed(renames):
        key = key.replace(memory, checkpoint)
    return key


def model_class_name(args: TransformersArgs) -> str:
    """The ``transformers`` class of the model of ``args``: its image-text or causal-LM class."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    names = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES if args.reads_images else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return str(names[args.model_type])


@functools.cache
def skipped_patterns(model_type: str) -> tuple[str, ...]:
    """The patterns of checkpoint tensors the causal LM class of ``model_type`` skips on loading
    (``_keys_to_ignore_on_load_unexpected``: DeepSeek-V3's ``model.layers.61`` multi-token-prediction layer)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, ""), None)
    return tuple(getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or ())


def _conversion_mapping(model_type: str) -> list[Any]:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    return list(get_checkpoint_conversion_mapping(model_type) or [])


def _correction_bias(args: TransformersArgs) -> bool:
    """Whether the routers of the blocks titanium's MoE computes hold a routing bias (DeepSeek-V3's sigmoid routers)."""
    return routed_moe(args)[0] is not None and corrects_routing(args.model_type)


TRANSFORMERS_HF_ADAPTER = TransformersHFAdapter(model_type="", layer_keys={}, top_keys={})
"""The backend's adapter (``model_type`` "": ``hf_family`` never picks the backend for a ``model_type``)."""

__all__ = ["TRANSFORMERS_HF_ADAPTER", "TransformersHFAdapter"]


def _renamed(key: str, prefixes: Prefixes) -> str:
    ours, theirs = next((o, t) for o, t in prefixes if key.startswith(o))
    return theirs + key.removeprefix(ours)
