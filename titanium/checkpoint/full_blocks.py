"""The model's weights, whole, from any training layout, one block at a time: what a rollout engine loads and what
the Hugging Face export writes.

A training rank holds its shards (FSDP, HSDP, TP: DTensors) of its pipeline stage's blocks. ``full_blocks`` walks
the model block by block (each transformer layer, and each module outside the layers on its own): the sharded
tensors of the block are gathered in full on every rank (the all-gather a forward does), converter wrappers are
undone, and only then the next block starts, so no rank ever holds more than one block beyond its shards. What
comes out is what the plain one-process model would hold:

- LoRA adapters are merged into their base weights (``W + scale B A``) and dropped; an NF4 base is dequantized;
- float8 training keeps its weights in high precision (its state dict already unwraps the all-gather wrapper), and
  QAT only fake-quantizes in the forward: both hand over their plain weights;
- names are the one-process names (``layers.3.attention.wq.weight``), without compile / checkpoint wrappers.

With pipeline parallelism each block lives on one stage: the stages agree on the order once, the owning stage
gathers the block and broadcasts it over the pipeline group, so every rank gets every block.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titanium.parallel.params import clean_fqn
from titanium.peft.merge import dense_full_tensor, lora_scales, merge_lora_state

_LAYER = re.compile(r"^(layers\.\d+)\.")

Block = dict[str, torch.Tensor]


def block_name(key: str) -> str:
    """The block a one-process state-dict key belongs to: ``layers.N`` for a layer's, else its top-level module
    (``output`` for ``output.weight`` and its LoRA adapters)."""
    match = _LAYER.match(key)
    return match.group(1) if match else key.split(".", 1)[0]


def local_blocks(model: nn.Module) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """This rank's state-dict entries (clean names, sharded values) grouped by block, in model order."""
    blocks: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for key, value in model.state_dict().items():
        name = clean_fqn(key)
        blocks.setdefault(block_name(name), []).append((name, value))
    return blocks


@torch.no_grad()
def gather_block(entries: list[tuple[str, torch.Tensor]], scales: dict[str, float]) -> Block:
    """One block's full, dense, merged tensors (collective over the mesh of any DTensor among them)."""
    return merge_lora_state({name: dense_full_tensor(value).detach() for name, value in entries}, scales)


@torch.no_grad()
def full_blocks(model: nn.Module, pp_group: dist.ProcessGroup | None = None) -> Iterator[Block]:
    """The whole policy as ``{one-process name: full tensor}`` blocks on the model's device, in model order.

    Collective: every rank of the training job iterates to the end (the gathers run over the model's meshes,
    and with ``pp_group``, the pipeline group of this rank, the broadcasts over it).
    """
    blocks, scales = local_blocks(model), lora_scales(model)
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        for entries in blocks.values():
            yield gather_block(entries, scales)
        return
    stages: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stages, list(blocks), group=pp_group)
    me = dist.get_rank(pp_group)
    device = next(iter(blocks.values()))[0][1].device
    for stage, names in enumerate(stages):  # stage order is model order
        source = dist.get_global_rank(pp_group, stage)
        for name in names:
            block = gather_block(blocks[name], scales) if stage == me else {}
            layout = [[(key, value.shape, value.dtype) for key, value in block.items()]]
            dist.broadcast_object_list(layout, src=source, group=pp_group)
            out: Block = {}
            for key, shape, dtype in layout[0]:
                tensor = block[key].contiguous() if stage == me else torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(tensor, src=source, group=pp_group)
                out[key] = tensor
            yield out
            del block, out  # before the next block is gathered: one block at a time
