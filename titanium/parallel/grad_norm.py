"""Gradient norm and clipping over any layout: plain, sharded on several meshes (expert parallelism), pipelined.

torch's ``clip_grad_norm_`` stacks the per-tensor norms, which DTensors on different meshes cannot be (under
expert parallelism the experts live on their own mesh). Here the gradients are grouped by mesh: one norm per
group, made a plain number with ``full_tensor`` (the reduction over that mesh), then squared and summed, and
summed over the pipeline stages when there are several.

Clipping scales each gradient by one coefficient. A gradient still pending its reduction (a ``Partial`` DTensor: a
sequence-parallel norm weight's, each tensor-parallel rank holding its part of the sum) is scaled by a plain
``mul_``: torch 2.11's ``_foreach_mul_`` (and ``clip_grads_with_norm_``) leave such a gradient unscaled, so under
tensor parallelism the norm weights escaped every clip (``tests/unit/test_grad_norm.py``).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[t.device_mesh if isinstance(t, DTensor) else None].append(t)
    return list(groups.values())


@torch.no_grad()
def clip_grad_norm(
    params: list[torch.Tensor],
    max_norm: float,
    pp_group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The global L2 norm of the gradients of ``params`` (a plain tensor, the same on every rank); with
    ``max_norm > 0`` the gradients are scaled down to it first if larger. ``device``: where the norm of no
    gradients at all lives (optimizer-in-backward has stepped and freed them; torch's would be on the CPU)."""
    grads = [p.grad for p in params if p.grad is not None]
    squares = []
    for group in _by_mesh(grads):
        norm = torch.nn.utils.get_total_norm(group, 2.0, foreach=True)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    norm = total.sqrt()
    if max_norm > 0:
        with_grads = [p for p in params if p.grad is not None]
        pending = [p.grad for p in with_grads if _is_pending(p.grad)]
        if pending:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # (clip_grads_with_norm_'s coefficient)
            for grad in pending:
                grad.mul_(coef)
        for group in _by_mesh([p for p in with_grads if not _is_pending(p.grad)]):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return norm


def _is_pending(grad: torch.Tensor) -> bool:
    """A DTensor gradient still pending its reduction over some mesh dimension (``Partial``)."""
    return isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements)
