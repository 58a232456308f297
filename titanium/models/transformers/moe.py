"""A backend model's Mixture-of-Experts blocks computed by titanium's MoE feed-forward, where their routing is one
titanium's router has.

``transformers`` 5 keeps the routed experts of most MoE architectures stacked, ``experts.gate_up_proj`` ``[E, 2I, H]``
(gate rows, then up rows) and ``experts.down_proj`` ``[E, H, I]`` (a SwiGLU each), beside a router ``gate`` whose
``weight`` is ``[E, H]``. Where the router computes what titanium's ``Router`` does (``ROUTING``, per ``model_type``:
softmax or sigmoid scores in float32, top-k, optional normalization and scaling of the chosen scores, DeepSeek-V3's
group-limited choice and its ``e_score_correction_bias``), the block's routed part becomes titanium's ``MoE``
(grouped GEMM, expert parallelism, and the ``[moe]`` load balancing: the auxiliary loss or the aux-loss-free bias)
under the block's own name, ``layers.N.mlp`` (``BackendMoE``); the block's shared experts, if it has any, stay the
model's own module and are added to the routed output as the block adds them. The weights map exactly
(``hf.py``): ``moe.experts.w1`` / ``w3`` are the gate / up halves of ``gate_up_proj``, ``w2`` is ``down_proj``,
``moe.router.gate.weight`` is the router's ``weight`` and ``moe.expert_bias`` DeepSeek-V3's correction bias (which,
like titanium's bias, only picks the experts: the gates stay the unbiased scores).

Any other MoE block runs as ``transformers`` wrote it: titanium can neither divide its experts over ranks nor
balance its routing, and the preflight checks refuse both (``checks.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from titanium.models.common.moe import GroupedExperts, MoE, MoEArgs

ROUTER, EXPERTS, SHARED = "gate", "experts", "shared_experts"
"""The names of the block's parts that ``BackendMoE`` takes over (router, routed experts) or keeps (shared)."""
CORRECTION_BIAS = "e_score_correction_bias"


def _softmax(router: nn.Module) -> dict[str, Any]:
    """Softmax over all experts, the top-k scores divided by their sum where the router says ``norm_topk_prob``."""
    return {"score_func": "softmax", "norm_topk_prob": bool(getattr(router, "norm_topk_prob", False))}


def _softmax_normalized(router: nn.Module) -> dict[str, Any]:
    """Softmax over all experts, the top-k scores always divided by their sum (Mixtral)."""
    return {"score_func": "softmax", "norm_topk_prob": True}


def _sigmoid_grouped(router: nn.Module) -> dict[str, Any]:
    """DeepSeek-V3: sigmoid scores, the choice on scores + correction bias among the best groups, the chosen
    (unbiased) scores normalized where ``norm_topk_prob``, times ``routed_scaling_factor``."""
    return {
        "score_func": "sigmoid",
        "norm_topk_prob": bool(router.norm_topk_prob),
        "route_scale": float(router.routed_scaling_factor),
        "n_groups": int(router.num_group),
        "topk_groups": int(router.topk_group),
    }


ROUTING: dict[str, Callable[[nn.Module], dict[str, Any]]] = {
    "qwen3_moe": _softmax,
    "olmoe": _softmax,
    "flex_olmo": _softmax,
    "cohere2_moe": _softmax,
    "mellum": _softmax,
    "mixtral": _softmax_normalized,
    "minimax": _softmax_normalized,
    "deepseek_v3": _sigmoid_grouped,
    "deepseek_v32": _sigmoid_grouped,
    "glm4_moe": _sigmoid_grouped,
    "dots3_note_text": _sigmoid_grouped,
    "mimo_v2_flash": _sigmoid_grouped,
    "sarvam_mla": _sigmoid_grouped,
    "solar_open": _sigmoid_grouped,
}
"""``model_type`` -> how its MoE blocks' router computes, in ``MoEArgs`` terms, read from the router module. Each
entry is checked by the compatibility matrix: the backend's logits equal ``transformers``' (tests/backend_matrix)."""


class BackendMoE(nn.Module):
    """A ``transformers`` MoE block whose routed experts titanium's ``MoE`` computes; its shared experts, if any, are
    the model's own module, added to the routed output."""

    def __init__(self, moe: MoE, shared_experts: nn.Module | None) -> None:
        super().__init__()
        self.moe = moe
        self.shared_experts = shared_experts

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.moe(hidden_states)
        return out if self.shared_experts is None else out + self.shared_experts(hidden_states)


def routed_moe_args(model_type: str, block: nn.Module) -> MoEArgs | None:
    """The ``MoEArgs`` of titanium's MoE that computes ``block``'s routed experts, or None where it cannot: a
    ``model_type`` without a ``ROUTING`` entry, or a block not laid out as the module docstring says."""
    routing = ROUTING.get(model_type)
    children = dict(block.named_children())
    if routing is None or not {ROUTER, EXPERTS} <= set(children) <= {ROUTER, EXPERTS, SHARED}:
        return None
    if list(block.parameters(recurse=False)) or list(block.buffers(recurse=False)) or getattr(block, "jitter_noise", 0):
        return None
    router, experts = children[ROUTER], children[EXPERTS]
    router_params = dict(router.named_parameters())
    expert_params = dict(experts.named_parameters())
    if set(router_params) != {"weight"} or set(expert_params) != {"gate_up_proj", "down_proj"}:
        return None
    if set(dict(router.named_buffers())) - {CORRECTION_BIAS} or list(router.children()):
        return None
    num_experts, dim = router_params["weight"].shape
    _, double, hidden = expert_params["gate_up_proj"].shape
    if hidden != dim or double % 2 or tuple(expert_params["down_proj"].shape) != (num_experts, dim, double // 2):
        return None
    if type(getattr(experts, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
        return None
    fields = routing(router)
    if (fields["score_func"] == "sigmoid") != hasattr(router, CORRECTION_BIAS):
        return None
    return MoEArgs(num_experts=num_experts, top_k=int(router.top_k), expert_dim=double // 2, **fields)


def swap_moe_blocks(model: nn.Module, model_type: str) -> tuple[MoEArgs | None, frozenset[int]]:
    """Replace the MoE blocks (``layers.N.mlp``) of ``model`` (a ``transformers`` causal LM, any device) that titanium's
    MoE can compute by ``BackendMoE``, in place; returns their args and layer numbers."""
    args, layers = None, set()
    for number, layer in enumerate(model.base_model.layers):
        block = getattr(layer, "mlp", None)
        found = routed_moe_args(model_type, block) if isinstance(block, nn.Module) else None
        if found is None:
            continue
        if args is not None and found != args:
            raise ValueError(f"{model_type}: MoE layers of different shapes ({args} and {found})")
        with torch.device(block.experts.gate_up_proj.device):
            moe = MoE(block.gate.weight.shape[1], found)
        layer.mlp = BackendMoE(moe, getattr(block, SHARED, None))
        args = found
        layers.add(number)
    return args, frozenset(layers)


def own_moe_blocks(layers: nn.Module, prefix: str) -> list[str]:
    """The MoE blocks in ``layers`` that run as ``transformers`` wrote them (their experts' module names, under
    ``prefix``): modules named ``experts`` or of an ``*Experts`` class, other than titanium's."""
    return [
        name
        for name, module in layers.named_modules(prefix=prefix)
        if (name.rsplit(".", 1)[-1] == EXPERTS or type(module).__name__.endswith("Experts"))
        and not isinstance(module, GroupedExperts)
    ]
