"""Mixture-of-Experts feed-forward: a token-choice top-k router, stacked SwiGLU experts, optional shared experts.

Each token picks ``top_k`` of ``num_experts`` experts from its router scores (softmax or sigmoid, in float32);
its output is the gate-weighted sum of those experts' outputs (Llama 4, ``score_before_experts``: the sum of their
outputs on gate-weighted copies of the token), plus the shared experts' (which every token uses). The experts'
weights are stacked, ``w1``/``w3`` ``[E, F, D]`` and ``w2`` ``[E, D, F]`` (expert e's slice is the ``[out, in]``
matrix of an ``nn.Linear``), and run as one grouped GEMM on the token copies sorted by expert.

Parallelism-agnostic, like the rest of ``models/common``: the experts are a submodule that is *called* with the
sorted tokens and the count per expert, so a parallel plan can wrap that call (expert parallelism sends the
tokens to the ranks that hold their experts and back) and FSDP gathers the experts' weights when it runs.

Load balancing has two hooks here, used by ``titanium/moe_balance.py``:

- ``expert_bias`` (a persistent buffer, zero unless aux-loss-free balancing trains it) is added to the scores
  only to *choose* the experts; the gate weights come from the unbiased scores (DeepSeek-V3). Every forward uses
  it: a trained bias is part of the model, so a frozen copy (a DPO reference), a rollout engine's copy or a run
  that balances otherwise must route as the model was trained to;
- ``tokens_per_expert`` accumulates the choices of each training forward (not again when activation
  checkpointing recomputes it, nor inside ``uncounted``), and with ``keep_routing_stats`` the last forward's
  counts and score sums stay in ``routing_stats`` for the Switch-style auxiliary loss (``switch_aux_loss``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from titanium.models.common.feed_forward import FeedForward

GroupedGemm = Literal["grouped_mm", "padded_bmm", "loop"]


@dataclass(frozen=True)
class MoEArgs:
    """One MoE feed-forward layer's architecture."""

    num_experts: int
    top_k: int
    """Experts each token is routed to."""
    expert_dim: int
    """Hidden width of each expert's SwiGLU (Hugging Face ``moe_intermediate_size``)."""
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = True
    """Divide the chosen experts' gate weights by their sum."""
    route_scale: float = 1.0
    """Multiplies the gate weights (after normalization)."""
    shared_expert_dim: int = 0
    """Hidden width of a SwiGLU every token goes through, added to the routed output; 0: none."""
    n_groups: int = 1
    """Group-limited routing (DeepSeek-V3): the experts form ``n_groups`` equal groups, each scored by the sum of its
    two best (biased) scores, and a token chooses its experts among those of its ``topk_groups`` best groups only;
    1: no groups."""
    topk_groups: int = 1
    score_before_experts: bool = False
    """Multiply each routed copy of a token by its gate weight before its expert rather than the expert's output
    after (Llama 4: the expert computes ``f(g x)``, not ``g f(x)``; a SwiGLU is not linear, so they differ)."""

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be between 1 and num_experts ({self.num_experts})")
        if self.expert_dim <= 0 or self.shared_expert_dim < 0:
            raise ValueError(f"expert_dim must be positive ({self.expert_dim}), shared_expert_dim >= 0")
        if self.n_groups > 1:
            per_group = self.num_experts // self.n_groups
            if self.num_experts % self.n_groups or per_group < 2 or not 1 <= self.topk_groups <= self.n_groups:
                raise ValueError(
                    f"group-limited routing needs n_groups ({self.n_groups}) dividing num_experts "
                    f"({self.num_experts}) into groups of at least 2 and 1 <= topk_groups ({self.topk_groups}) <= "
                    "n_groups"
                )
            if self.top_k > self.topk_groups * per_group:
                raise ValueError(f"top_k ({self.top_k}) is more than the experts of topk_groups ({self.topk_groups})")


@dataclass
class RoutingStats:
    """What the auxiliary loss needs from one forward of one layer."""

    counts: torch.Tensor
    """Token copies routed to each expert ``[E]`` (float32, no gradient)."""
    score_sums: torch.Tensor
    """Router scores summed over the tokens ``[E]`` (float32, with gradient)."""
    tokens: int


def grouped_gemm_kind(x: torch.Tensor, w1: torch.Tensor, device_type: str | None = None) -> GroupedGemm:
    """The fastest exact grouped GEMM for ``x``'s device and dtype (benchmarks/moe_layer.py measures them).

    ``torch._grouped_mm`` is CUDA's fast path in bfloat16, where it needs rows of a multiple of 16 bytes (both
    widths of ``w1`` ``[E, F, D]`` a multiple of 8); it also runs (exactly) on CPU, but there padding every
    group to the largest and one ``bmm`` was faster in both float32 and bfloat16. ``device_type`` overrides
    ``x``'s (the memory estimate traces a GPU's choice on CPU fake tensors).
    """
    aligned = all(n * x.element_size() % 16 == 0 for n in w1.shape[1:])
    if (device_type or x.device.type) == "cuda" and x.dtype == torch.bfloat16 and aligned:
        return "grouped_mm"
    return "padded_bmm"


def expert_swiglu(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    kind: GroupedGemm | None = None,
    sizes: list[int] | None = None,
) -> torch.Tensor:
    """``w2[e](silu(w1[e] x) * w3[e] x)`` for rows ``x`` ``[N, D]`` sorted by expert, ``counts[e]`` rows each.

    ``sizes``: the counts as Python numbers when the caller knows them (saves a device-to-host sync; the memory
    estimate assumes them, since its fake tensors hold no values)."""
    kind = kind or grouped_gemm_kind(x, w1)
    if kind == "grouped_mm":
        offsets = counts.cumsum(0).to(torch.int32)

        def gemm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets)

        return gemm(F.silu(gemm(x, w1)) * gemm(x, w3), w2)
    if sizes is None:
        sizes = counts.tolist()  # (a host sync: the loop and the padding need the group sizes)
    if kind == "loop":
        outs = [
            F.linear(F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e]), w2[e])
            for e, rows in enumerate(x.split(sizes))
        ]
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])
    width = max(sizes, default=0)
    starts = counts.cumsum(0) - counts
    expert = torch.repeat_interleave(torch.arange(len(sizes), device=x.device), counts, output_size=x.shape[0])
    slot = expert * width + torch.arange(x.shape[0], device=x.device) - starts[expert]
    padded = x.new_zeros(len(sizes) * width, x.shape[1]).index_copy(0, slot, x).view(len(sizes), width, x.shape[1])
    hidden = F.silu(torch.bmm(padded, w1.transpose(-2, -1))) * torch.bmm(padded, w3.transpose(-2, -1))
    return torch.bmm(hidden, w2.transpose(-2, -1)).flatten(0, 1).index_select(0, slot)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts with stacked weights; called with rows sorted by expert and their counts.

    Kept as its own module so a parallel plan can wrap the call (expert parallelism) and shard it on its own. Every
    parameter it holds, a converter's included, is per expert (leading dimension ``num_experts``).
    """

    weight_update: Callable[[GroupedExperts, list[torch.Tensor]], list[torch.Tensor]] | None = None
    """Set (on the instance) by a converter that trains an update of the experts' weights (LoRA,
    ``titanium/peft/expert_lora.py``): ``[w1, w2, w3]`` as this rank holds them -> the weights to compute with."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` ``[N, D]`` sorted by expert, ``counts`` ``[E]`` -> ``[N, D]``."""
        return self.compute(x, counts, *self.updated([self.w1, self.w2, self.w3]))

    def updated(self, weights: list[torch.Tensor]) -> list[torch.Tensor]:
        """The weights to compute with: ``weights`` with the converter's update, if one is set."""
        return weights if self.weight_update is None else self.weight_update(self, weights)

    def compute(
        self, x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
    ) -> torch.Tensor:
        """The experts' arithmetic on rows sorted by expert, with the weights they hold here. A seam: the memory
        estimate replaces it (on the instance) with a routing assumption of static shapes."""
        return expert_swiglu(x, counts, w1, w2, w3)

    def init_weights(self, out_init_std: float, in_init_std: float, generator: torch.Generator | None) -> None:
        """As ``FeedForward``: ``w1`` gets ``in_init_std``, ``w2``/``w3`` the depth-scaled ``out_init_std``."""
        for weight, std in ((self.w1, in_init_std), (self.w2, out_init_std), (self.w3, out_init_std)):
            nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)


class Router(nn.Module):
    """Token-choice top-k: scores in float32, the choice on ``scores + bias``, the gates from the scores."""

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=False)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[T, D]`` -> (gate weights ``[T, k]`` float32, chosen experts ``[T, k]``, scores ``[T, E]``)."""
        logits = self.gate(x).float()
        scores = logits.softmax(dim=-1) if self.args.score_func == "softmax" else logits.sigmoid()
        choice = scores + expert_bias
        if self.args.n_groups > 1:
            choice = best_groups_only(choice, self.args.n_groups, self.args.topk_groups)
        chosen = choice.topk(self.args.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.args.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.args.route_scale != 1.0:
            weights = weights * self.args.route_scale
        return weights, chosen, scores


def best_groups_only(choice: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """``choice`` ``[T, E]`` with the experts outside each token's ``topk_groups`` best groups at -inf (a group's
    score: the sum of its two best values), as DeepSeek-V3 routes."""
    grouped = choice.view(choice.shape[0], n_groups, -1)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    kept = group_scores.topk(topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)


class MoE(nn.Module):
    """Router -> tokens sorted by expert -> grouped experts -> gate-weighted sum (+ shared experts)."""

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.router = Router(dim, args)
        self.experts = GroupedExperts(dim, args.expert_dim, args.num_experts)
        self.shared_experts = FeedForward(dim, args.shared_expert_dim) if args.shared_expert_dim else None
        self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)
        # Integer counts: a whole-model cast to bfloat16 (generation) must not round them.
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.long), persistent=False)
        self.keep_routing_stats = False
        """Keep ``routing_stats`` of each forward (the auxiliary loss); set by the load balancer."""
        self.routing_stats: RoutingStats | None = None
        self.counting = True
        """Whether training forwards count (see ``uncounted``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., D]`` -> ``[..., D]``."""
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen, scores = self.router(tokens, self.expert_bias)
        flat = chosen.flatten()
        counts = torch.zeros_like(self.tokens_per_expert).scatter_add_(0, flat, torch.ones_like(flat))
        self._record(counts, scores, tokens.shape[0])
        order = flat.argsort(stable=True)
        rows = tokens.index_select(0, order // self.args.top_k)
        if self.args.score_before_experts:  # (in the tokens' dtype, as Llama 4 scales them)
            rows = rows * weights.flatten().index_select(0, order).to(rows.dtype).unsqueeze(-1)
        routed = self.experts(rows, counts)
        by_slot = torch.empty_like(routed).index_copy(0, order, routed).view(*chosen.shape, -1)
        if self.args.score_before_experts:
            out = by_slot.sum(dim=1)
        else:
            out = (by_slot.float() * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.view_as(x)

    def _record(self, counts: torch.Tensor, scores: torch.Tensor, tokens: int) -> None:
        # The first run of a training forward only: activation checkpointing repeats it inside the backward.
        recomputing = torch._C._current_graph_task_id() != -1
        if not (self.counting and self.training and torch.is_grad_enabled()) or recomputing:
            return
        self.tokens_per_expert += counts
        if self.keep_routing_stats:
            self.routing_stats = RoutingStats(counts.float(), scores.sum(dim=0), tokens)

    def init_buffers(self) -> None:
        """No routing bias, no counts (what a fresh model starts from)."""
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()

    def init_weights(
        self, out_init_std: float, in_init_std: float = 0.02, generator: torch.Generator | None = None
    ) -> None:
        std = in_init_std
        nn.init.trunc_normal_(self.router.gate.weight, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)
        self.experts.init_weights(out_init_std, in_init_std, generator)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(out_init_std, in_init_std, generator)
        self.init_buffers()


def switch_aux_loss(counts: torch.Tensor, score_sums: torch.Tensor, rows: torch.Tensor | float) -> torch.Tensor:
    """The Switch Transformer load-balancing loss as ``transformers`` computes it for Qwen3-MoE and Mixtral:
    ``E * sum_e f_e * P_e`` with ``f_e = counts_e / rows`` (routed copies) and ``P_e = score_sums_e / rows``
    (mean router probability), where counts, score sums and rows are summed over all MoE layers together."""
    return counts.numel() * (counts * score_sums).sum() / (rows * rows)


def moe_layers(model: nn.Module) -> dict[int, MoE]:
    """The MoE feed-forwards of ``model`` (or of a pipeline stage) by layer number, through any wrappers."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            match = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
            assert match, f"an MoE outside a numbered block: {name}"
            found[int(match.group(1))] = module
    return dict(sorted(found.items()))


@contextlib.contextmanager
def uncounted(model: nn.Module) -> Iterator[None]:
    """Forwards of ``model`` inside do not count towards load balancing: runs that are not training steps but
    look like them (torch 2.13's pipeline stages infer their shapes with a training forward on their first
    step)."""
    layers = list(moe_layers(model).values())
    for layer in layers:
        layer.counting = False
    try:
        yield
    finally:
        for layer in layers:
            layer.counting = True
