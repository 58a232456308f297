"""Float8 training as a model converter: torchao's ``Float8Linear`` in place of the chosen ``nn.Linear`` layers.

A float8 layer keeps its weight in high precision and casts each matmul's operands to float8 on the fly with
dynamic scales (per tensor or per row, by recipe), so checkpoints, the optimizer and every other converter see
an ordinary weight. With FSDP and the tensorwise recipe the weights can be all-gathered already in float8
(``enable_fsdp_float8_all_gather``); their scales are then best computed for all layers at once after the
optimizer step (``precompute_float8_dynamic_scale_for_fsdp``), which is this converter's step hook. Under
tensor parallelism the family's plan picks torchao's float8 styles for these layers
(titanium/models/common/parallelize.py), so the TP all-gathers move float8 too.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torchao.float8 import (
    Float8LinearConfig,
    _auto_filter_for_recipe,
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
)
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

from titanium.config.loader import ConfigError
from titanium.config.sections import Float8Section
from titanium.models.converter import ConverterContext, ModelConverter
from titanium.parallel.params import clean_fqn
from titanium.quantize import check_filters_match, filtered_by_name

logger = logging.getLogger("titanium")

_MIN_CAPABILITY = {"tensorwise": (8, 9), "rowwise": (9, 0), "rowwise_with_gw_hp": (9, 0)}
"""CUDA compute capability of float8 tensor cores (8.9: Ada, 9.0: Hopper) and of the rowwise-scaled kernels."""


def check_float8_hardware(cfg: Float8Section, device_type: str) -> None:
    """Real float8 needs float8 tensor cores; anything else must ask for emulation."""
    if cfg.emulate:
        return
    need = _MIN_CAPABILITY[cfg.recipe]
    if device_type != "cuda":
        raise ConfigError(
            f"--float8.enable needs a CUDA GPU with float8 tensor cores; this run is on {device_type}: add "
            "--float8.emulate (float8 rounding in high-precision matmuls, for tests; no speed-up)"
        )
    have = torch.cuda.get_device_capability()
    if have < need:
        tensorwise = " or --float8.recipe tensorwise" if have >= _MIN_CAPABILITY["tensorwise"] else ""
        raise ConfigError(
            f"--float8.recipe {cfg.recipe} needs CUDA compute capability {need[0]}.{need[1]}+; "
            f"{torch.cuda.get_device_name()} has {have[0]}.{have[1]}: use --float8.emulate (no speed-up){tensorwise}"
        )


def float8_module_filter(cfg: Float8Section) -> Callable[[nn.Module, str], bool]:
    """``(module, name) -> convert?`` for torchao: linear layers not named in ``filter_fqns`` whose dimensions
    are multiples of 16, and (``auto_filter_small_kn``) large enough for torchao's recipe table."""
    auto = _auto_filter_for_recipe(cfg.recipe, filter_fqns=[]) if cfg.auto_filter_small_kn else None

    def convert(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear) or filtered_by_name(clean_fqn(name), cfg.filter_fqns):
            return False
        if module.in_features % 16 or module.out_features % 16:
            return False
        return auto is None or auto(module, name)

    return convert


class Float8Converter(ModelConverter):
    """torchao float8 training for the linear layers ``float8_module_filter`` picks.

    ``fsdp``: the weights will be FSDP-sharded (float8 all-gather applies only then). ``device_type``: where
    the run computes (None: do not check the hardware, e.g. a dry run).
    """

    name = "float8"

    def __init__(self, cfg: Float8Section, *, fsdp: bool, device_type: str | None) -> None:
        if device_type is not None:
            check_float8_hardware(cfg, device_type)
        self.cfg = cfg
        self.all_gather = cfg.enable_fsdp_float8_all_gather and fsdp
        if cfg.enable_fsdp_float8_all_gather and not fsdp:
            logger.warning("--float8.enable_fsdp_float8_all_gather is ignored: this run does not shard with FSDP")
        self.precompute = cfg.precompute_float8_dynamic_scale_for_fsdp and self.all_gather

    @classmethod
    def from_config(cls, section: Float8Section, ctx: ConverterContext) -> Float8Converter | None:
        return cls(section, fsdp=ctx.fsdp, device_type=ctx.device_type) if section.enable else None

    def convert(self, model: nn.Module) -> None:
        config = dataclasses.replace(
            Float8LinearConfig.from_recipe_name(self.cfg.recipe),
            emulate=self.cfg.emulate,
            enable_fsdp_float8_all_gather=self.all_gather,
        )
        module_filter = float8_module_filter(self.cfg)
        linears = [clean_fqn(name) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
        check_filters_match(self.cfg.filter_fqns, linears, "--float8.filter_fqns")
        convert_to_float8_training(model, module_filter_fn=module_filter, config=config)
        if self.all_gather:
            for module in model.modules():
                if isinstance(module, Float8Linear):
                    module.register_state_dict_post_hook(_save_plain_weight)
        converted = set(float8_layers(model))
        kept = [name for name in linears if name not in converted]
        logger.info(
            "float8 (%s%s): %d linear layers converted; kept in high precision: %s",
            self.cfg.recipe,
            ", emulated" if self.cfg.emulate else "",
            len(converted),
            ", ".join(kept) or "none",
        )

    def after_optimizer_step(self, model_parts: list[nn.Module]) -> None:
        if self.precompute:
            for part in model_parts:
                precompute_float8_dynamic_scale_for_fsdp(part)

    def describe(self) -> str:
        return f"float8 {self.cfg.recipe}" + (" (emulated)" if self.cfg.emulate else "")


def float8_layers(model: nn.Module) -> list[str]:
    """Clean names of the model's float8 linear layers."""
    return [clean_fqn(name) for name, m in model.named_modules() if isinstance(m, Float8Linear)]


def _save_plain_weight(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State dicts (checkpoints, exports) hold the weight itself, not torchao's float8 all-gather wrapper around
    it: such a checkpoint loads without float8, in any tool (unpickling the wrapper needs torchao's allowlist)."""
    key = prefix + "weight"
    value = state_dict.get(key)
    local = value.to_local() if isinstance(value, DTensor) else value
    if not isinstance(local, WeightWithDynamicFloat8CastTensor):
        return
    if not isinstance(value, DTensor):
        state_dict[key] = local._tensor
        return
    shape, stride = value.shape, value.stride()
    state_dict[key] = DTensor.from_local(
        local._tensor, value.device_mesh, value.placements, run_check=False, shape=shape, stride=stride
    )
