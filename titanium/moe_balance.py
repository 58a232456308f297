"""Load balancing of MoE models over ranks and steps (``[moe]``): the auxiliary loss, the aux-loss-free bias, and the
per-layer load metrics.

The MoE layers (``models/common/moe.py``) only count their routing choices and keep their statistics; everything
that needs all ranks happens here. The loop never names it: ``register_load_balancing`` is registered with the
``[moe]`` section (titanium/config/components.py) and hooks the balancer into the loop (titanium/hooks.py):

1. ``aux_loss()`` after each training microbatch's forward, before its backward: the term added to that
   microbatch's loss (registered only for ``load_balance = "aux_loss"``);
2. ``after_optimizer_step()``: the step's token counts summed over the ranks, and the bias update;
3. ``metrics()`` on logging steps.

The auxiliary loss is ``transformers``' (``E * sum_e f_e P_e`` over all MoE layers together). Its routed-token
fractions ``f_e`` and the row count are all-reduced over the ranks that share the step's tokens (data and context
parallel), so its value, and its gradient summed by FSDP, are those of one process with the whole batch; with
gradient accumulation each microbatch counts 1/N. Each rank adds ``coef * E * sum_e f_e^global P_e^local``, which
is linear in its own router scores, so the gradients add up exactly.

Aux-loss-free balancing (DeepSeek-V3, arXiv 2408.15664): after each optimizer step every layer moves its bias by
``rate * sign(mean load - load)`` (then centred: a shift common to all experts changes no choice), so overloaded
experts get chosen less. The bias only picks the experts; the gates stay the router's scores.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from titanium.config.loader import ConfigError
from titanium.config.sections import MoESection
from titanium.hooks import HookContext, TrainingHooks
from titanium.models.common.decoder import FamilyArgs
from titanium.models.common.moe import MoE, moe_layers, switch_aux_loss
from titanium.models.hf_adapter import HFAdapter

logger = logging.getLogger("titanium")


class LoadBalancer:
    """This rank's MoE layers (under pipeline parallelism: its stages') and the step's balancing state."""

    def __init__(
        self,
        cfg: MoESection,
        layers: dict[int, MoE],
        *,
        aux_loss_coef: float,
        microbatches: int,
        loss_group: dist.ProcessGroup,
        pp_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.mode, self.rate, self.coef = cfg.load_balance, cfg.bias_update_rate, aux_loss_coef
        self.layers, self.microbatches = layers, microbatches
        self.loss_group, self.pp_group = loss_group, pp_group
        for layer in layers.values():
            layer.keep_routing_stats = self.mode == "aux_loss"
        device = next((layer.expert_bias.device for layer in layers.values()), torch.device("cpu"))
        self._aux = torch.zeros((), device=device)
        self._step_aux = torch.zeros((), device=device)
        self._loads: torch.Tensor | None = None

    def aux_loss(self) -> torch.Tensor | None:
        """The auxiliary-loss term of the microbatch whose forward just ran (add it before its backward)."""
        if self.mode != "aux_loss" or not self.layers:
            return None
        stats = []
        for layer in self.layers.values():
            assert layer.routing_stats is not None, "aux_loss() needs a training forward first"
            stats.append(layer.routing_stats)
            layer.routing_stats = None
        counts = torch.stack([s.counts for s in stats]).sum(0)
        rows = counts.new_tensor([float(sum(s.tokens for s in stats))])
        total = funcol.all_reduce(torch.cat([counts, rows]), "sum", self.loss_group)
        score_sums = torch.stack([s.score_sums for s in stats]).sum(0)
        aux = switch_aux_loss(total[:-1], score_sums, total[-1]) / self.microbatches
        self._aux += aux.detach()
        return self.coef * aux

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Sum the step's token counts over the ranks, move the biases (``bias``), start counting afresh."""
        self._step_aux, self._aux = self._aux, torch.zeros_like(self._aux)
        if not self.layers:
            return
        counts = torch.stack([layer.tokens_per_expert for layer in self.layers.values()])
        loads = funcol.wait_tensor(funcol.all_reduce(counts, "sum", self.loss_group)).float()
        if self.mode == "bias":
            for layer, load in zip(self.layers.values(), loads):
                layer.expert_bias += self.rate * torch.sign(load.mean() - load)
                layer.expert_bias -= layer.expert_bias.mean()
        for layer in self.layers.values():
            layer.tokens_per_expert.zero_()
        self._loads = loads

    def metrics(self) -> dict[str, float]:
        """The last step's load per layer (tokens of the busiest expert / the mean) and auxiliary loss."""
        out: dict[str, float] = {}
        max_load: dict[int, float] = {}
        if self._loads is not None:
            ratios = self._loads.max(dim=-1).values / self._loads.mean(dim=-1).clamp(min=1e-9)
            max_load = dict(zip(self.layers, ratios.tolist()))
        if self.pp_group is not None:  # each stage holds its own layers
            gathered: list[dict[int, float] | None] = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(gathered, max_load, group=self.pp_group)
            max_load = {k: v for part in gathered if part for k, v in part.items()}
        if max_load:
            out["moe/max_load"] = max(max_load.values())
            out.update({f"moe/max_load/layer_{layer}": value for layer, value in sorted(max_load.items())})
        if self.mode == "aux_loss":
            out["moe/aux_loss"] = funcol.all_reduce(self._step_aux, "sum", self.loss_group).item()
        return out


def check_moe_config(cfg: MoESection, args: FamilyArgs, *, pipeline: bool, hf_export_adapter: HFAdapter | None) -> None:
    """``[moe]`` against the model and the job (a preflight check too): the aux loss needs all layers in one
    backward (no pipeline stages) and a coefficient; a bias needs a slot in the format the run exports to."""
    if args.decoder_args().moe is None:
        return
    if cfg.load_balance == "aux_loss" and pipeline:
        raise ConfigError(
            "--moe.load_balance aux_loss sums router statistics over all layers before the backward, which pipeline "
            "stages cannot; use --moe.load_balance bias (or none) with --parallelism.pipeline_parallel_degree > 1"
        )
    if cfg.load_balance == "aux_loss" and cfg.aux_loss_coef is None and _model_aux_coef(args) is None:
        raise ConfigError(
            "--moe.aux_loss_coef: this model has no default (its config states no router_aux_loss_coef); set it "
            "(e.g. 0.001), or balance with --moe.load_balance bias"
        )
    export = "--checkpoint.last_save_in_hf could not export the model"
    check_bias_reaches_hf(cfg, hf_export_adapter, reader=export, fix="unset --checkpoint.last_save_in_hf")


def check_bias_reaches_hf(cfg: MoESection, adapter: HFAdapter | None, *, reader: str, fix: str) -> None:
    """A trained routing bias must reach what reads the model in Hugging Face format through ``adapter`` (an
    export, vLLM's weight sync): refused where the format has no slot for it. ``reader``: what would fail."""
    if cfg.load_balance == "bias" and adapter is not None and not adapter.has_hf_slot("layers.0.moe.expert_bias"):
        raise ConfigError(
            f"--moe.load_balance bias trains a routing bias that the Hugging Face {adapter.model_type} format has "
            f"no slot for, so {reader}; use --moe.load_balance aux_loss, or {fix}"
        )


def _model_aux_coef(args: FamilyArgs) -> float | None:
    return getattr(args, "router_aux_loss_coef", None)


def build_load_balancer(
    cfg: MoESection,
    model: nn.Module,
    args: FamilyArgs,
    *,
    microbatches: int,
    loss_group: dist.ProcessGroup,
    pp_group: dist.ProcessGroup | None,
    hf_export_adapter: HFAdapter | None,
) -> LoadBalancer | None:
    """The balancer of an MoE model (``args`` are the family's; ``model`` this rank's parameters), None for a dense
    one. ``hf_export_adapter``: the family's HF adapter when the run ends with an HF export."""
    if args.decoder_args().moe is None:
        if cfg != MoESection():
            logger.warning("[moe] settings are ignored: %s is a dense model", type(model).__name__)
        return None
    check_moe_config(cfg, args, pipeline=pp_group is not None, hf_export_adapter=hf_export_adapter)
    coef = cfg.aux_loss_coef if cfg.aux_loss_coef is not None else _model_aux_coef(args)
    return LoadBalancer(
        cfg,
        moe_layers(model),
        aux_loss_coef=coef or 0.0,
        microbatches=microbatches,
        loss_group=loss_group,
        pp_group=pp_group,
    )


def register_load_balancing(cfg: MoESection, ctx: HookContext, hooks: TrainingHooks) -> None:
    """Hook the load balancing of an MoE policy into the loop (nothing for a dense one)."""
    built = ctx.built
    balancer = build_load_balancer(
        cfg,
        built.model,
        built.args,
        microbatches=ctx.microbatches,
        loss_group=ctx.loss_group,
        pp_group=built.pp_group,
        hf_export_adapter=built.spec.hf_adapter if ctx.hf_export else None,
    )
    if balancer is None:
        return
    if balancer.mode == "aux_loss":
        hooks.loss_term.register(lambda batch: balancer.aux_loss())
    hooks.after_optimizer_step.register(lambda step: balancer.after_optimizer_step())
    hooks.metrics.register(lambda step: balancer.metrics())
