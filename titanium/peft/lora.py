"""LoRA: low-rank adapters on the frozen linear layers of a decoder.

``apply_lora`` turns each targeted ``nn.Linear`` into a ``LoRALinear`` *in place* (its class is swapped
and two small children are added), so the base weight keeps its name (``layers.0.attention.wq.weight``):
Hugging Face loading, DCP and the parallel plans see the model they already know, plus ``lora_a`` /
``lora_b`` children. It runs on the meta model before any parallelism; FSDP2 then shards each block's
adapters together with its frozen base weights.

The output is ``W x + scale * B A dropout(x)`` with ``scale = alpha / rank`` (rsLoRA: ``alpha / sqrt(rank)``);
``B`` starts at zero, so at initialisation the adapted model computes exactly what the base model computes.
DoRA (``use_dora``) adds a trainable magnitude per output row, ``lora_magnitude``, starting at the row norms of
``W``; the layer then computes with ``m / ||W + scale B A||_row * (W + scale B A)`` (titanium/peft/dora.py).
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titanium.config.loader import ConfigError
from titanium.config.sections import LoRASection
from titanium.models.common.moe import GroupedExperts
from titanium.models.hf_adapter import HFAdapter
from titanium.parallel.params import clean_fqn, copy_full_into
from titanium.peft.dora import dora_output, weight_norm
from titanium.peft.expert_lora import add_expert_adapters, expert_lora_modules, init_expert_lora
from titanium.peft.nf4 import linear_nf4, to_nf4

LATENT_ATTENTION = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
"""The latent-attention projections of DeepSeek-V2/V3 models (built by the transformers backend)."""
TARGET_GROUPS = {"attention": ("wq", "wk", "wv", "wo", *LATENT_ATTENTION), "mlp": ("w1", "w2", "w3")}
"""A group adapts those of its layers a model has (one at least)."""
TARGETS = ("wq", "wk", "wv", "wo", *TARGET_GROUPS["mlp"], "output", "experts", *LATENT_ATTENTION)
"""``experts``: the stacked projections of every MoE layer's routed experts (``titanium/peft/expert_lora.py``)."""
_HF_NAMES = {
    "q_proj": "wq",
    "k_proj": "wk",
    "v_proj": "wv",
    "o_proj": "wo",
    "gate_proj": "w1",
    "down_proj": "w2",
    "up_proj": "w3",
    "lm_head": "output",
}
"""Hugging Face leaf names of the layers a model built by the transformers backend keeps, -> titanium's."""
LORA_PARTS = ("lora_a", "lora_b", "lora_magnitude")


class LoRAConfigError(ConfigError):
    """A ``[lora]`` setting that cannot work; the message names the flag and what would."""


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a trainable low-rank update; only made by ``apply_lora`` (class swap).

    ``base_nf4`` is set by QLoRA once ``weight`` holds a torchao ``NF4Tensor``; ``lora_enabled = False``
    computes the base layer alone (the policy as its own frozen reference, without a second copy).
    ``lora_magnitude`` is DoRA's magnitude vector (one per output row), None for plain LoRA.
    """

    lora_a: nn.Linear
    lora_b: nn.Linear
    lora_dropout: nn.Module
    lora_scale: float
    lora_magnitude: nn.Parameter | None
    base_nf4: bool
    lora_enabled: bool = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.base_nf4:
            base = linear_nf4(x, self.weight)
            if self.bias is not None:
                base = base + self.bias
        else:
            base = super().forward(x)  # the adapted layer's own forward (nn.Linear's, or see LORA_CLASSES)
        if not self.lora_enabled:
            return base
        dropped = self.lora_dropout(x)
        update = self.lora_b(self.lora_a(dropped)) * self.lora_scale
        if self.lora_magnitude is None:
            return base + update
        return dora_output(self, x, dropped, base, update)

    def extra_repr(self) -> str:
        nf4 = ", base=nf4" if self.base_nf4 else ""
        dora = ", dora" if self.lora_magnitude is not None else ""
        return f"{super().extra_repr()}, rank={self.lora_a.out_features}, scale={self.lora_scale:g}{dora}{nf4}"


LORA_CLASSES: dict[type[nn.Module], type[LoRALinear]] = {nn.Linear: LoRALinear}
"""Layer class -> the LoRA class it becomes. A converter that runs before LoRA registers its own linear class
here (with a LoRA subclass whose base forward is that layer's: QAT's fake-quantized linear), so LoRA adapts
the layer as it will run; LoRA refuses any other class."""


def is_lora_param(name: str) -> bool:
    """Whether a parameter/state-dict name belongs to an adapter (``...wq.lora_a.weight``, ``...wq.lora_magnitude``)."""
    return any(part in LORA_PARTS for part in name.split("."))


def adapter_key_parts(name: str) -> tuple[str, str]:
    """``layers.0.attention.wq.lora_b.weight`` -> ``("layers.0.attention.wq", "lora_b")``: the adapted weight's
    name without ``.weight`` and the adapter part a parameter name belongs to. Stacked experts' adapters name the
    projection last: ``layers.0.moe.experts.lora_b.w1`` -> ``("layers.0.moe.experts.w1", "lora_b")``."""
    parts = name.split(".")
    index = next(i for i, part in enumerate(parts) if part in LORA_PARTS)
    projection = parts[index + 1 : index + 2]
    return ".".join(parts[:index] + [p for p in projection if p != "weight"]), parts[index]


def lora_scale(cfg: LoRASection) -> float:
    """The factor of the update ``B A x``: ``alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA."""
    return cfg.alpha / (math.sqrt(cfg.rank) if cfg.use_rslora else cfg.rank)


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """``(clean name, module)`` of every adapted layer, in module order."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield clean_fqn(name), module


@torch.no_grad()
def quantize_lora_base_nf4(model: nn.Module, shard_degree: int = 1) -> int:
    """Replace the base weight of every adapted layer by its NF4 quantization (frozen); returns the count.

    Call once the base weights hold their final values (after initialisation and the Hugging Face
    load) and before ``fully_shard``: the weights must be plain tensors here. Every rank quantizes the
    full weight (one set of statistics per tensor) and FSDP2 then shards the NF4 tensor with torchao's
    all-gather hooks; ``shard_degree`` is the FSDP shard degree it will be split into.
    """
    count = 0
    for name, module in lora_modules(model):
        if module.base_nf4:
            continue
        weight = module.weight
        if isinstance(weight, DTensor) or weight.is_meta:
            where = "sharded (a DTensor)" if isinstance(weight, DTensor) else "on the meta device"
            raise RuntimeError(
                f"quantize_lora_base_nf4: {name}.weight is {where}; quantize materialized, unsharded weights "
                "(after loading, before fully_shard)"
            )
        module.weight = nn.Parameter(to_nf4(weight, f"{name}.weight", shard_degree), requires_grad=False)
        module.base_nf4 = True
        count += 1
    return count


def has_lora(model: nn.Module) -> bool:
    return next(lora_modules(model), None) is not None or bool(expert_lora_modules(model))


ALL_LINEAR = "all-linear"
"""PEFT's shorthand: every linear layer of the blocks (attention and MLP), not the output projection."""
_REGEX_CHARACTERS = frozenset("*+?|()[]{}^$\\")


def resolve_targets(names: list[str]) -> frozenset[str]:
    """``[lora] target_modules`` -> the set of titanium layer names it names (its names and groups, and
    ``all-linear``); the other entries are PEFT's (``peft_targets``), matched against Hugging Face names. A model
    built by the transformers backend keeps Hugging Face names inside its blocks (``q_proj``): ``layer_role`` gives
    their titanium names, so titanium's names and groups find its layers too."""
    out: set[str] = set()
    for name in names:
        if name in TARGET_GROUPS:
            out.update(TARGET_GROUPS[name])
        elif name in TARGETS:
            out.add(name)
        elif name == ALL_LINEAR:
            out.update(TARGET_GROUPS["attention"] + TARGET_GROUPS["mlp"])
    return frozenset(out)


def required_targets(names: list[str]) -> list[frozenset[str]]:
    """What ``target_modules`` requires the model to have: each named layer, and one layer at least of each group."""
    return [frozenset(TARGET_GROUPS[n]) if n in TARGET_GROUPS else frozenset({layer_role(n)}) for n in names]


def layer_role(leaf: str) -> str:
    """A layer's name (its last name component) as ``target_modules`` names it: ours (``wq``) for ours and for the
    Hugging Face name of the same layer (``q_proj``: a model built by the transformers backend keeps HF's names)."""
    return _HF_NAMES.get(leaf, leaf)


def peft_targets(names: list[str]) -> list[str]:
    """The entries of ``[lora] target_modules`` spelled as PEFT spells them: Hugging Face module names (``q_proj``,
    ``self_attn.o_proj``) or regular expressions; a bad expression fails."""
    targets = [name for name in names if name not in TARGET_GROUPS and name not in TARGETS and name != ALL_LINEAR]
    for name in targets:
        if _is_regex(name):
            try:
                re.compile(name)
            except re.error as e:
                raise LoRAConfigError(f"--lora.target_modules: {name!r} is not a regular expression ({e})") from None
    return targets


def _is_regex(target: str) -> bool:
    return bool(_REGEX_CHARACTERS & set(target))


def peft_matches(target: str, hf_module: str) -> bool:
    """PEFT's rule for a ``target_modules`` entry and a module's Hugging Face name
    (``model.layers.0.self_attn.q_proj``): a regular expression matches the whole name (PEFT's single-string form),
    a name matches itself or a suffix after a dot."""
    if _is_regex(target):
        return re.fullmatch(target, hf_module) is not None
    return hf_module == target or hf_module.endswith(f".{target}")


def hf_module_name(name: str, hf_adapter: HFAdapter | None) -> str | None:
    """A linear layer's Hugging Face module name (``layers.0.attention.wq`` -> ``model.layers.0.self_attn.q_proj``),
    through the family's adapter; None where it has none."""
    if hf_adapter is None:
        return None
    try:
        return hf_adapter.hf_key(f"{name}.weight").removesuffix(".weight")
    except KeyError:
        return None


def _hf_layer_names(hf_adapter: HFAdapter) -> list[str]:
    """The Hugging Face names of a family's adaptable linear layers, as in its first block (for checks and hints)."""
    blocks = [f"layers.0.attention.{leaf}" for leaf in TARGET_GROUPS["attention"]]
    blocks += [f"layers.0.feed_forward.{leaf}" for leaf in TARGET_GROUPS["mlp"]]
    return [n for name in [*blocks, "output"] if (n := hf_module_name(name, hf_adapter)) is not None]


def check_peft_targets(names: list[str], hf_adapter: HFAdapter | None, family: str) -> None:
    """Each PEFT-spelled entry of ``[lora] target_modules`` names a linear layer of the family (by its Hugging Face
    name), as PEFT would find it in the family's transformers model."""
    targets = peft_targets(names)
    if not targets:
        return
    if hf_adapter is None:
        raise LoRAConfigError(
            f"--lora.target_modules {', '.join(targets)}: Hugging Face names need a family with a Hugging Face "
            f"adapter, and {family} has none; use titanium's names ({', '.join(TARGETS)}, attention, mlp)"
        )
    known = _hf_layer_names(hf_adapter)
    for target in targets:
        if not any(peft_matches(target, name) for name in known):
            leaves = sorted({name.rsplit(".", 1)[-1] for name in known})
            raise LoRAConfigError(
                f"--lora.target_modules: {target!r} matches no linear layer of {family} (its Hugging Face names: "
                f"{', '.join(leaves)}; titanium's: {', '.join(TARGETS)}, attention, mlp, all-linear)"
            )


def check_lora_config(cfg: LoRASection) -> None:
    """Fail on settings that cannot work (the config validator reports the same earlier)."""
    if cfg.rank < 0:
        raise LoRAConfigError(f"--lora.rank must be >= 0 (0 turns LoRA off), got {cfg.rank}")
    if not 0 <= cfg.dropout < 1:
        raise LoRAConfigError(f"--lora.dropout must be in [0, 1), got {cfg.dropout}")
    if cfg.quantize_base not in ("none", "nf4"):
        raise LoRAConfigError(f"--lora.quantize_base must be 'none' or 'nf4', got {cfg.quantize_base!r}")
    if cfg.rank == 0:
        if cfg.quantize_base != "none":
            raise LoRAConfigError("--lora.quantize_base nf4 (QLoRA) needs LoRA: set --lora.rank (e.g. 8)")
        for flag in ("use_dora", "use_rslora"):
            if getattr(cfg, flag):
                raise LoRAConfigError(f"--lora.{flag} needs LoRA: set --lora.rank (e.g. 8)")
        return
    if not cfg.alpha > 0:
        raise LoRAConfigError(f"--lora.alpha must be > 0 (the update is scaled by alpha / rank), got {cfg.alpha}")
    if not cfg.target_modules:
        raise LoRAConfigError("--lora.target_modules is empty; name layers to adapt, e.g. attention or wq,wv")
    peft_targets(cfg.target_modules)


def _shared_weights(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def apply_lora(model: nn.Module, cfg: LoRASection, hf_adapter: HFAdapter | None = None) -> list[str]:
    """Add adapters to the layers named by ``cfg.target_modules``; returns the adapted layer names. Entries spelled
    as PEFT spells them (``q_proj``, regular expressions) are matched against each layer's Hugging Face name through
    ``hf_adapter``, the family's, as PEFT matches them on the transformers model.

    Call on the meta model, before pipeline splitting and parallelism (the adapters are created on the
    base weight's device and dtype). ``rank == 0`` leaves the model untouched.
    """
    check_lora_config(cfg)
    if cfg.rank == 0:
        return []
    targets, hf_targets = resolve_targets(cfg.target_modules), peft_targets(cfg.target_modules)
    shared = _shared_weights(model)
    chosen: list[tuple[str, nn.Linear]] = []
    experts: list[tuple[str, GroupedExperts]] = []
    matched: set[str] = set()
    vision = tuple(getattr(model, "vision_names", ()))  # (an image-text model's vision tower and projector)
    every_vision_linear = cfg.vision_modules and ALL_LINEAR in cfg.target_modules  # (PEFT's all-linear: all of them)
    for name, module in model.named_modules():
        in_vision = name.split(".", 1)[0] in vision
        if in_vision and not cfg.vision_modules:
            continue
        leaf = name.rsplit(".", 1)[-1]
        hf_name = hf_module_name(clean_fqn(name), hf_adapter) if hf_targets and isinstance(module, nn.Linear) else None
        by_hf = {target for target in hf_targets if hf_name is not None and peft_matches(target, hf_name)}
        matched |= by_hf
        if layer_role(leaf) not in targets and not by_hf and not (in_vision and every_vision_linear):
            continue
        if isinstance(module, LoRALinear) or (isinstance(module, GroupedExperts) and module.weight_update):
            raise ValueError(f"{name} already has a LoRA adapter (apply_lora called twice?)")
        if isinstance(module, GroupedExperts):
            experts.append((name, module))
            continue
        if not isinstance(module, nn.Linear):
            continue
        if type(module) not in LORA_CLASSES:
            raise LoRAConfigError(
                f"--lora.target_modules: {name!r} is a {type(module).__name__} (converted by float8?); LoRA adapts "
                "nn.Linear and QAT layers: turn that conversion off for these layers or drop them from the targets"
            )
        if cfg.use_dora and type(module) is not nn.Linear:
            raise LoRAConfigError(
                f"--lora.use_dora: {name!r} is a {type(module).__name__} (QAT); DoRA normalizes the plain weight, "
                "so turn off --lora.use_dora or --qat.enable"
            )
        if id(module.weight) in shared:
            raise LoRAConfigError(
                f"--lora.target_modules: {name!r} shares its weight with another layer (tied embeddings); "
                f"remove {leaf!r} from --lora.target_modules"
            )
        chosen.append((name, module))
    if set(hf_targets) - matched:
        check_peft_targets(hf_targets, hf_adapter, hf_adapter.model_type if hf_adapter else "this model")
        unmatched = sorted(set(hf_targets) - matched)
        raise LoRAConfigError(f"--lora.target_modules: no layer of the model matches {', '.join(unmatched)}")
    found = {layer_role(name.rsplit(".", 1)[-1]) for name, _ in [*chosen, *experts]}
    named = [
        name for name in cfg.target_modules if name in TARGETS or name in TARGET_GROUPS
    ]  # (all-linear: what it has)
    missing = set().union(*(names for names in required_targets(named) if not names & found))
    if missing:
        names = ", ".join(sorted(missing))
        what = "MoE experts" if missing == {"experts"} else "linear layer"
        raise LoRAConfigError(f"--lora.target_modules: the model has no {what} named {names}")
    if experts and (cfg.use_dora or cfg.dropout > 0 or cfg.quantize_base != "none"):
        raise LoRAConfigError(
            "--lora.target_modules experts: the experts' adapters are a weight update (no dropout on their input, "
            "no DoRA, no NF4 base); set --lora.dropout 0, --lora.use_dora false and --lora.quantize_base none, or "
            "drop experts from the targets"
        )
    # Only now change the model, so a failed call leaves it as it was.
    for _, module in chosen:
        _add_adapter(module, cfg)
    for _, module in experts:
        add_expert_adapters(module, cfg.rank, lora_scale(cfg))
    return [clean_fqn(name) for name, _ in [*chosen, *experts]]


def _add_adapter(module: nn.Linear, cfg: LoRASection) -> None:
    weight = module.weight
    factory = {"device": weight.device, "dtype": weight.dtype}
    module.__class__ = LORA_CLASSES[type(module)]
    assert isinstance(module, LoRALinear)
    module.lora_a = nn.Linear(module.in_features, cfg.rank, bias=False, **factory)
    module.lora_b = nn.Linear(cfg.rank, module.out_features, bias=False, **factory)
    module.lora_dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
    module.lora_scale = lora_scale(cfg)
    module.lora_magnitude = nn.Parameter(torch.empty(module.out_features, **factory)) if cfg.use_dora else None
    module.base_nf4 = False


@torch.no_grad()
def init_lora(model: nn.Module, seed: int | None = None) -> None:
    """``lora_a`` Kaiming-uniform (PEFT's default), ``lora_b`` zeros: the adapted model starts as the base.
    DoRA's magnitudes start at the row norms of the base weights (so the layer still computes ``W x``).

    Each adapter is drawn on the CPU from its own generator, seeded with ``seed`` (by default one draw
    from torch's global generator) and its name, and DTensor parameters keep their shard of the full
    draw. The values therefore depend only on the seed: not on the device, the parallel layout, or
    which layers this rank holds (pipeline stages). Call once the base weights hold their starting values
    (initialized or loaded, and NF4-quantized for QLoRA): DoRA reads them. Collective for sharded DoRA layers.
    """
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    for name, experts in expert_lora_modules(model):
        init_expert_lora(name, experts, seed)
    for name, module in lora_modules(model):
        generator = torch.Generator().manual_seed((seed + zlib.crc32(name.encode())) % 2**63)
        a = torch.empty(tuple(module.lora_a.weight.shape))
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        copy_full_into(module.lora_a.weight, a)
        copy_full_into(module.lora_b.weight, torch.zeros(tuple(module.lora_b.weight.shape)))
        if module.lora_magnitude is not None:
            copy_full_into(module.lora_magnitude, weight_norm(module, full=True))


def freeze_base(model: nn.Module) -> int:
    """Only adapter parameters train; returns how many elements do (this rank's share when sharded)."""
    trainable = 0
    for name, param in model.named_parameters():
        param.requires_grad_(is_lora_param(name))
        if param.requires_grad:
            trainable += (param.to_local() if isinstance(param, DTensor) else param).numel()
    return trainable


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter parameters by clean name (DTensors stay sharded)."""
    return {clean_fqn(name): param for name, param in model.named_parameters() if is_lora_param(name)}
