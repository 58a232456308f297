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

Llama 4's blocks (``Llama4TextMoe``, in the image-text model) differ in their names and layout only (``BLOCKS``):
``layers.N.feed_forward`` with a ``router`` and a ``shared_expert``, experts stored to multiply from the left
(``gate_up_proj`` ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``: ours transposed), a pair returned (output, router
logits); their router chooses the top-k of the raw logits, then takes the sigmoid of the chosen ones, which is the
top-k of the sigmoid scores (a monotonic function), and the score scales the expert's input
(``MoEArgs.score_before_experts``).

Any other MoE block runs as ``transformers`` wrote it: titanium can neither divide its experts over ranks nor
balance its routing, and the preflight checks refuse both (``checks.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from titanium.models.common.moe import GroupedExperts, MoE, MoEArgs

EXPERTS = "experts"
CORRECTION_BIAS = "e_score_correction_bias"


@dataclasses.dataclass(frozen=True)
class BlockNames:
    """Where an architecture's MoE block and its parts are, and how it stores and returns them."""

    block: str = "mlp"
    """The decoder layer's attribute holding the block."""
    router: str = "gate"
    """The block's router (taken over by titanium's ``MoE``)."""
    shared: str = "shared_experts"
    """The block's shared experts, if any (kept as the model's own module, under this name)."""
    inputs_first: bool = False
    """The stacked experts multiply from the left, ``x @ W``: ``gate_up_proj`` ``[E, H, 2I]`` and ``down_proj``
    ``[E, I, H]`` (Llama 4), ours transposed; otherwise ``[E, 2I, H]`` and ``[E, H, I]``, as ours."""
    returns_pair: bool = False
    """The block returns (output, router logits), which its decoder layer unpacks (Llama 4)."""


BLOCKS = {
    "llama4": BlockNames("feed_forward", "router", "shared_expert", inputs_first=True, returns_pair=True),
}
"""``model_type`` -> its MoE blocks' names where they are not ``BlockNames()``'s."""


def block_names(model_type: str) -> BlockNames:
    return BLOCKS.get(model_type, BlockNames())


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


def _sigmoid_scaling_inputs(router: nn.Module) -> dict[str, Any]:
    """Llama 4: the sigmoid of the chosen experts' logits, not normalized, multiplying the expert's input."""
    return {"score_func": "sigmoid", "norm_topk_prob": False, "score_before_experts": True}


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
    "llama4": _sigmoid_scaling_inputs,
}
"""``model_type`` -> how its MoE blocks' router computes, in ``MoEArgs`` terms, read from the router module. Each
entry is checked by the compatibility matrix: the backend's logits equal ``transformers``' (tests/backend_matrix)."""


def corrects_routing(model_type: str) -> bool:
    """Whether the routers of ``model_type`` choose with a correction bias (DeepSeek-V3's, ``_sigmoid_grouped``)."""
    return ROUTING.get(model_type) is _sigmoid_grouped


class BackendMoE(nn.Module):
    """A ``transformers`` MoE block whose routed experts titanium's ``MoE`` computes; its shared experts, if any, are
    the model's own module (under the block's name for them), added to the routed output."""

    def __init__(self, moe: MoE, shared: nn.Module | None, names: BlockNames) -> None:
        super().__init__()
        self.moe = moe
        self.shared_name, self.returns_pair = names.shared, names.returns_pair
        setattr(self, names.shared, shared)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, None]:
        out = self.moe(hidden_states)
        shared = getattr(self, self.shared_name)
        out = out if shared is None else out + shared(hidden_states)
        return (out, None) if self.returns_pair else out


def routed_moe_args(model_type: str, block: nn.Module) -> MoEArgs | None:
    """The ``MoEArgs`` of titanium's MoE that computes ``block``'s routed experts, or None where it cannot: a
    ``model_type`` without a ``ROUTING`` entry, or a block not laid out as the module docstring says."""
    routing, names = ROUTING.get(model_type), block_names(model_type)
    children = dict(block.named_children())
    if routing is None or not {names.router, EXPERTS} <= set(children) <= {names.router, EXPERTS, names.shared}:
        return None
    if list(block.parameters(recurse=False)) or list(block.buffers(recurse=False)) or getattr(block, "jitter_noise", 0):
        return None
    router, experts = children[names.router], children[EXPERTS]
    router_params = dict(router.named_parameters())
    expert_params = dict(experts.named_parameters())
    if set(router_params) != {"weight"} or set(expert_params) != {"gate_up_proj", "down_proj"}:
        return None
    if set(dict(router.named_buffers())) - {CORRECTION_BIAS} or list(router.children()):
        return None
    num_experts, dim = router_params["weight"].shape
    gate_up, down = (tuple(expert_params[name].shape) for name in ("gate_up_proj", "down_proj"))
    if names.inputs_first:  # (as ours: [E, 2I, H] and [E, H, I])
        gate_up, down = (gate_up[0], gate_up[2], gate_up[1]), (down[0], down[2], down[1])
    _, double, hidden = gate_up
    if hidden != dim or double % 2 or down != (num_experts, dim, double // 2):
        return None
    if type(getattr(experts, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
        return None
    fields = routing(router)
    if corrects_routing(model_type) != hasattr(router, CORRECTION_BIAS):
        return None
    return MoEArgs(num_experts=num_experts, top_k=int(router.top_k), expert_dim=double // 2, **fields)


def swap_moe_blocks(base: nn.Module, model_type: str) -> tuple[MoEArgs | None, frozenset[int]]:
    """Replace the MoE blocks (``layers.N.mlp``, or the architecture's name: ``BLOCKS``) of ``base`` (a
    ``transformers`` language model: embeddings, layers, norm; any device) that titanium's MoE can compute by
    ``BackendMoE``, in place; returns their args and layer numbers."""
    names = block_names(model_type)
    args, layers = None, set()
    for number, layer in enumerate(base.layers):
        block = getattr(layer, names.block, None)
        found = routed_moe_args(model_type, block) if isinstance(block, nn.Module) else None
        if found is None:
            continue
        if args is not None and found != args:
            raise ValueError(f"{model_type}: MoE layers of different shapes ({args} and {found})")
        with torch.device(block.experts.gate_up_proj.device):
            moe = MoE(getattr(block, names.router).weight.shape[1], found)
        setattr(layer, names.block, BackendMoE(moe, getattr(block, names.shared, None), names))
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
