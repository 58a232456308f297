"""Llama 3's tensor-parallel plan (Megatron-style TP with sequence parallelism): ModelSpec.tp_plan.

Inside a block, wq/wk/wv and w1/w3 are split by output rows (each rank holds whole heads / a slice
of the hidden width) and wo/w2 by input columns, so each half-block needs one all-gather in and one
reduce-scatter out. Between blocks the activations stay split along the sequence (Shard(1)), and so
do the norms that run on them (SequenceParallel). The output projection is split by vocabulary:
with loss parallel the logits stay vocabulary-sharded into the cross-entropy. A one-output score head (a reward
or value model's) has no vocabulary to split: ``score_head_plan``.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titanium.models.common.parallelize import linear_styles, score_head_plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Shard a Llama 3 ``Transformer`` (or a pipeline stage of one) over ``tp_mesh`` in place."""
    root_plan = {}
    if model.tok_embeddings is not None:
        root_plan["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        )
    if model.norm is not None:
        root_plan["norm"] = SequenceParallel()
    if model.output is not None and model.output.out_features == 1:
        score_head_plan(model.output, tp_mesh)
    elif model.output is not None:
        root_plan["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)
    # Pipeline stages exchange plain tensors: the local sequence shards of the hidden states.
    if model.tok_embeddings is None:
        parallelize_module(
            model,
            tp_mesh,
            PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=False),
        )
    if model.output is None:
        parallelize_module(
            model,
            tp_mesh,
            PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Shard(1), use_local_output=True),
        )
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, _block_plan(block, tp_mesh.device_type))
    # Tied embeddings: both sides are sharded by vocabulary rows (Shard(0)), so one DTensor serves both.
    if model.args.tie_word_embeddings and model.tok_embeddings is not None and model.output is not None:
        model.output.weight = model.tok_embeddings.weight


def _block_plan(block: nn.Module, device_type: str) -> dict:
    """One block's plan; float8 layers get torchao's float8 styles (models/common/parallelize.py)."""
    attn = block.attention
    qkv, wo = linear_styles(device_type, attn.wq, attn.wk, attn.wv), linear_styles(device_type, attn.wo)
    # The attention also takes its AttentionInputs (RoPE tables, positions, document ids): left alone (None).
    plan = {
        "attention_norm": SequenceParallel(),
        "attention": qkv.prepare_input(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": qkv.colwise(),
        "attention.wk": qkv.colwise(),
        "attention.wv": qkv.colwise(),
        "attention.wo": wo.rowwise(output_layouts=Shard(1), use_local_output=False),
        "ffn_norm": SequenceParallel(),
    }
    if getattr(block, "moe", None) is not None:
        # An MoE feed-forward is not split: every TP rank routes the whole (gathered) sequence through it, with
        # plain weights, and keeps its own part of the output. Its weights stay replicas: the ranks compute
        # identical gradients (expert parallelism, not TP, is what divides the experts).
        plan["moe"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=False,
        )
        return plan
    ffn = block.feed_forward
    up, down = linear_styles(device_type, ffn.w1, ffn.w3), linear_styles(device_type, ffn.w2)
    plan["feed_forward"] = up.prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan["feed_forward.w1"] = up.colwise()
    plan["feed_forward.w2"] = down.rowwise(output_layouts=Shard(1), use_local_output=False)
    plan["feed_forward.w3"] = up.colwise()
    return plan
