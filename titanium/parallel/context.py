"""Context parallelism: each sequence is split over the cp ranks; attention gathers keys and values.

Every rank keeps its queries and gathers K/V of the whole sequence (all-gather-KV). The gather is
``all_gather_tensor_autograd``, whose backward is a reduce-scatter, so dK/dV come back to their owners
on any backend (``torch.distributed.nn.functional.all_gather`` returns wrong gradients on gloo when the
incoming gradient is not contiguous). With causal attention the later chunks of a sequence do more work,
so the sequence is cut into 2 x cp chunks and rank r keeps chunks r and 2cp-1-r (head-tail balancing).
RoPE and the causal mask use the tokens' global positions, which travel with the batch.

The model knows nothing of this: ``apply_context_parallel`` swaps the class of each attention module
for a subclass whose ``attend`` gathers K/V; the parameter names do not change.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanium.models.common.attention import (
    Attention,
    AttentionInputs,
    document_causal_mask,
    masked_attention,
    repeat_kv,
)


def headtail_indices(seq_len: int, cp_size: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Positions kept by ``cp_rank``: chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size``."""
    chunk = seq_len // (2 * cp_size)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    tail_start = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([head, torch.arange(tail_start, tail_start + chunk, device=device)])


def shard_batch(batch: dict[str, torch.Tensor], cp_mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    """This rank's part of every ``[B, S]`` tensor of ``batch``, plus ``positions`` ``[B, S / cp]``."""
    seq_len = batch["input"].shape[1]
    index = headtail_indices(seq_len, cp_mesh.size(), cp_mesh.get_local_rank(), batch["input"].device)
    out = {k: v[:, index] if v.dim() >= 2 and v.shape[1] == seq_len else v for k, v in batch.items()}
    if "positions" not in batch:  # packed samples bring their own (restarting) positions
        out["positions"] = index.expand(batch["input"].shape[0], -1)
    return out


class _ContextParallelAttend:
    """Mixin overriding ``Attention.attend``: local queries attend to the gathered sequence."""

    cp_group: object

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        positions, document_ids = inputs.positions, inputs.document_ids
        if positions is None:
            raise ValueError("context parallel attention needs the tokens' global positions")
        group = self.cp_group
        k = funcol.all_gather_tensor_autograd(k.contiguous(), gather_dim=1, group=group)
        v = funcol.all_gather_tensor_autograd(v.contiguous(), gather_dim=1, group=group)
        if positions.dim() == 1:
            positions = positions.expand(q.shape[0], -1)
        key_positions = funcol.all_gather_tensor(positions.contiguous(), gather_dim=1, group=group)
        if document_ids is None:  # one document per row: causal by position
            mask = (key_positions[:, None, :] <= positions[:, :, None]).unsqueeze(1)
        else:
            key_documents = funcol.all_gather_tensor(document_ids.contiguous(), gather_dim=1, group=group)
            mask = document_causal_mask(positions, key_positions, document_ids, key_documents)
        return masked_attention(q, repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep), mask)


_CLASSES: dict[type, type] = {}


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Make every attention module of ``model`` context-parallel over ``cp_mesh``, in place."""
    group = cp_mesh.get_group()
    for module in model.modules():
        if isinstance(module, Attention) and not isinstance(module, _ContextParallelAttend):
            cls = type(module)
            if cls not in _CLASSES:
                _CLASSES[cls] = type(f"ContextParallel{cls.__name__}", (_ContextParallelAttend, cls), {})
            module.__class__ = _CLASSES[cls]
            module.cp_group = group
