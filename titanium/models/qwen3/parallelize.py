"""Qwen3's tensor-parallel plan: Llama 3's plan plus the per-head q/k norms.

Under Llama's plan each rank holds whole heads of ``wq``/``wk`` and sees local ``[B, S, H/tp, D]``
queries and keys. The q/k norms act per head, so their math is unchanged on a shard, but their
weights are shared by all heads: each rank only sees the gradient from its own heads. Making them
replicated DTensors and feeding them the local heads as ``Shard(2)`` (the head dim) makes autograd
sum those partial gradients over the TP group, so the replicas stay identical.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from titanium.models.llama3.parallelize import apply_tensor_parallel as apply_llama_tensor_parallel


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Shard a Qwen3 ``Qwen3Transformer`` (or a pipeline stage of one) over ``tp_mesh`` in place."""
    apply_llama_tensor_parallel(model, tp_mesh, loss_parallel)
    # "SequenceParallel" is just the style that replicates a norm's weight and shards its input
    # along one dim; here that dim is the heads (2), not the sequence.
    norm_plan = {
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, norm_plan)
