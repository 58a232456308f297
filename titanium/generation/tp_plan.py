"""The titanium engine sharded over tensor-parallel ranks: a decoding copy of the policy that no rank holds whole.

The ranks of one data-parallel rank's tensor-parallel group generate the same rows (same prompts, seed and synced
weights), so they can share one copy split over them. Training's plan does not fit decoding: it keeps the
activations between blocks split along the sequence (sequence parallelism), and a decode step has one token. Here
activations stay whole on every rank: each block's q/k/v and gate/up projections are split by output rows (whole
heads per rank, so the KV cache holds only the rank's heads), its output and down projections by input columns
with their partial sums all-reduced, and the output projection by vocabulary with the logits gathered whole, so
every rank samples the same token from the same logits with the same seed. Embeddings, norms and MoE
feed-forwards stay whole on every rank (as does a tied output projection, which is the embedding). Per decoded
token: one all-reduce per half block and one all-gather of the logits.

The engine's collectives run on a process group of its own with the same ranks as the training's tensor-parallel
group (``decoding_group``): generation may run on a thread of its own while the loop's thread uses the training
groups, and collectives of one group must not interleave from two threads.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def decoding_group(tp_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A new group of the same ranks as ``tp_group``, for the engine alone. Collective over the whole job: every
    rank names every tensor-parallel group in the same order."""
    mine = tuple(dist.get_process_group_ranks(tp_group))
    everyone: list[tuple[int, ...] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    groups = sorted({ranks for ranks in everyone if ranks is not None})
    group, _ = dist.new_subgroups_by_enumeration([list(ranks) for ranks in groups])
    assert group is not None and tuple(dist.get_process_group_ranks(group)) == mine
    return group


def shard_for_decoding(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split ``model`` (a family's decoder, on any device, meta included) over ``mesh`` in place (module docstring)."""
    for block in model.layers.values():
        plan = {f"attention.{name}": ColwiseParallel() for name in ("wq", "wk", "wv")}
        plan["attention.wo"] = RowwiseParallel()
        if getattr(block, "feed_forward", None) is not None:  # (an MoE block's experts stay whole)
            plan.update({"feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel()})
            plan["feed_forward.w2"] = RowwiseParallel()
        parallelize_module(block, mesh, plan)
    if model.output is not None and not model.args.tie_word_embeddings:
        parallelize_module(model, mesh, {"output": ColwiseParallel(output_layouts=Replicate())})
