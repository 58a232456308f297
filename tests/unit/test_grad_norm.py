"""Gradient clipping over DTensor gradients of every placement, on 2 gloo processes: sharded, replicated, and pending
their reduction (``Partial``: a sequence-parallel norm weight's gradient under tensor parallelism), the last of
which torch 2.11's foreach multiply left unscaled (``titanium/parallel/grad_norm.py``). Run on 2.11 too by
``scripts/test_torch_version.sh``."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from titanium.parallel.grad_norm import clip_grad_norm


def _worker(rank: int, world: int, store: str, max_norm: float, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)  # (the same on both ranks)
        sharded, replicated, parts = torch.randn(4, 8), torch.randn(1, 8), torch.randn(world, 8)
        layouts = [[Shard(0)], [Replicate()], [Replicate()]]
        shapes = [sharded.shape, replicated.shape, parts.shape[1:]]
        params = [nn.Parameter(distribute_tensor(torch.zeros(s), mesh, p)) for s, p in zip(shapes, layouts)]
        params.append(nn.Parameter(torch.zeros(3)))  # (plain, the same on every rank)
        params[0].grad = distribute_tensor(sharded.clone(), mesh, [Shard(0)])
        params[1].grad = distribute_tensor(replicated.clone(), mesh, [Replicate()])
        params[2].grad = DTensor.from_local(parts[rank].clone(), mesh, [Partial()])  # (their sum: the gradient)
        params[3].grad = torch.ones(3)
        norm = clip_grad_norm(params, max_norm)
        grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in params]
        results[rank] = (float(norm), [g.clone() for g in grads])
        results["expected"] = [sharded, replicated, parts.sum(dim=0), torch.ones(3)]
    finally:
        dist.destroy_process_group()


def _clipped(tmp_path: Path, max_norm: float):
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), max_norm, results), nprocs=2, join=True)
    return results[0], results[1], results["expected"]


def test_every_placement_is_clipped_by_the_global_norm(tmp_path: Path) -> None:
    (norm0, grads0), (norm1, grads1), expected = _clipped(tmp_path, 1.0)
    whole = torch.cat([g.flatten() for g in expected]).norm()
    assert norm0 == norm1 and abs(norm0 - whole) <= 1e-6 * whole
    scale = 1.0 / (whole + 1e-6)
    for got0, got1, want in zip(grads0, grads1, expected):
        torch.testing.assert_close(got0, want * scale, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got1, got0, rtol=0, atol=0)


def test_gradients_under_the_norm_are_left_as_they_are(tmp_path: Path) -> None:
    (norm0, grads0), _, expected = _clipped(tmp_path, 1000.0)
    for got, want in zip(grads0, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
