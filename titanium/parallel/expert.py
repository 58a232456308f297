"""Expert parallelism: each MoE layer's experts are divided over the ``ep`` ranks, and tokens travel to them.

The ``ep`` ranks are borrowed from the data-parallel shard dimension (``dp_shard x cp = efsdp x ep``, see
``ParallelDims``): they read different tokens, so every rank routes its own tokens and sends each routed copy to
the rank that holds its expert, which runs its ``num_experts / ep`` experts on everything it received and sends
the results back. Expert weights are ``Shard(0)`` DTensors on the ``ep`` mesh; FSDP shards them further over
``efsdp`` (``parallel/fsdp.py``), while everything else is sharded over all data-parallel ranks as usual.

One layer's exchange, in ``dispatch`` and ``combine``:

1. the per-expert counts go to the experts' owners (an even all-to-all of ``[E]`` counts), and the row splits
   come to the host (one device-to-host sync per layer: ``all_to_all_single`` needs the split sizes);
2. the rows, already sorted by expert, go out in one uneven ``all_to_all_single`` (differentiable: its backward
   is the reverse exchange of the gradients);
3. what arrives is ordered by source rank, then expert; a stable sort by expert makes it expert-major for the
   grouped GEMM, and ``combine`` undoes the sort and sends the outputs back the same way.

The model knows nothing of this: ``apply_expert_parallel`` swaps the class of each ``GroupedExperts`` for a
subclass whose ``forward`` wraps the local computation in the exchange; the parameter names do not change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from titanium.models.common.moe import GroupedExperts, moe_layers


@dataclass(frozen=True)
class Exchange:
    """How one layer's rows were sent, so ``combine`` sends the outputs back the same way."""

    order: torch.Tensor
    """Received rows (source-rank-major) -> expert-major."""
    sent: list[int]
    """Rows sent to each ep rank."""
    received: list[int]
    """Rows received from each ep rank."""


def dispatch(
    x: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup, assumed_imbalance: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, Exchange]:
    """Send rows ``x`` (sorted by expert; ``counts[e]`` for each of the ``E`` global experts) to the ranks holding
    their experts. Returns this rank's rows sorted by its local expert, their counts ``[E / ep]``, the exchange.

    ``assumed_imbalance`` (the memory estimate, on fake tensors that hold no counts): instead of the real split
    sizes, assume balanced routing in which this rank receives ``assumed_imbalance`` times its even share."""
    ep = dist.get_world_size(group)
    local_experts = counts.numel() // ep
    # incoming[r, e]: rows that rank r routed to this rank's local expert e.
    incoming = funcol.all_to_all_single(counts, None, None, group).view(ep, local_experts)
    if assumed_imbalance is None:
        sent, received = torch.stack([counts.view(ep, local_experts).sum(1), incoming.sum(1)]).tolist()
    else:
        n = x.shape[0]
        sent = [n // ep + (1 if r < n % ep else 0) for r in range(ep)]
        received = [math.ceil(n / ep * assumed_imbalance)] * ep
    rows = funcol.all_to_all_single_autograd(x, received, sent, group)
    experts = torch.arange(local_experts, device=x.device).repeat(ep)
    expert_of_row = experts.repeat_interleave(incoming.flatten(), output_size=sum(received))
    order = expert_of_row.argsort(stable=True)
    return rows.index_select(0, order), incoming.sum(0), Exchange(order, sent, received)


def combine(out: torch.Tensor, exchange: Exchange, group: dist.ProcessGroup) -> torch.Tensor:
    """Send the experts' outputs back to where their rows came from, in the order they were sent."""
    by_source = torch.empty_like(out).index_copy(0, exchange.order, out)
    return funcol.all_to_all_single_autograd(by_source, exchange.sent, exchange.received, group)


class ExpertParallelExperts(GroupedExperts):
    """``GroupedExperts`` whose weights are ``Shard(0)`` on the ep mesh: tokens travel to their experts and back."""

    ep_group: dist.ProcessGroup
    assumed_imbalance: float | None = None
    """Set by the memory estimate only (see ``dispatch``)."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        rows, local_counts, exchange = dispatch(x, counts, self.ep_group, self.assumed_imbalance)
        weights = [w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3)]
        return combine(self.compute(rows, local_counts, *self.updated(weights)), exchange, self.ep_group)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Divide the experts of every MoE layer of ``model`` (on the meta device) over ``ep_mesh``, in place."""
    for moe in moe_layers(model).values():
        experts = moe.experts
        for name, weight in list(experts.named_parameters()):  # (a converter's per-expert parameters too: LoRA)
            owner_name, _, leaf = name.rpartition(".")
            owner = experts.get_submodule(owner_name)
            setattr(owner, leaf, nn.Parameter(distribute_tensor(weight, ep_mesh, [Shard(0)]), weight.requires_grad))
        experts.__class__ = ExpertParallelExperts
        experts.ep_group = ep_mesh.get_group()
