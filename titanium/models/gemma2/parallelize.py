"""Gemma 2's tensor-parallel plan: Llama 3's plan plus the norms after attention and the MLP.

Those norms read the outputs of ``wo`` and ``w2``, which Llama's plan leaves split along the sequence
(``Shard(1)``) like the residual stream, so they run sequence-parallel like the block's other norms.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from titanium.models.llama3.parallelize import apply_tensor_parallel as apply_llama_tensor_parallel


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Shard a Gemma 2 decoder (or a pipeline stage of one) over ``tp_mesh`` in place."""
    apply_llama_tensor_parallel(model, tp_mesh, loss_parallel)
    for block in model.layers.values():
        parallelize_module(
            block, tp_mesh, {"post_attention_norm": SequenceParallel(), "post_ffn_norm": SequenceParallel()}
        )
