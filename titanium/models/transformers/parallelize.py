"""A backend model's tensor-parallel plan: its config's ``base_model_tp_plan`` in torch's parallel styles.

The plan's styles map onto torch's as ``transformers`` defines them: ``colwise`` splits a linear layer by output
rows and leaves its output split (the heads or the MLP's hidden width per rank), ``rowwise`` splits it by input
columns and all-reduces its output, ``colwise_gather_output`` / ``rowwise_split_input`` do the same with whole
activations on both sides (OLMo 2 normalizes the whole query), and ``replicated_with_grad_allreduce`` (Qwen3's
per-head q/k norms, which see only the rank's heads) keeps a norm's weight whole and sums its gradient over the
ranks. The activations between those layers stay plain, whole tensors on every rank, so the model's own code
(norms, residuals, RoPE, its multipliers) runs on them untouched: no sequence parallelism, which would need to
know every operation on the residual stream.

Around the plan, as for the native families: the embedding and the LM head are split by vocabulary (one DTensor
when they are tied), with loss parallel the logits stay split by vocabulary into the loss, and the final norm's
output is a replicated DTensor, so a loss that projects by itself (chunked cross-entropy) sums the hidden states'
partial gradients over the ranks.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titanium.config.loader import ConfigError
from titanium.models.transformers.plans import tensor_parallel_problems, tp_plan

LAYERS = "layers.*."


def torch_style(style: str) -> ParallelStyle:
    """The torch style of one ``transformers`` style name (``plans.TRANSLATED_STYLES``)."""
    if style == "colwise":
        return ColwiseParallel()
    if style == "colwise_gather_output":
        return ColwiseParallel(output_layouts=Replicate())
    if style == "rowwise":
        return RowwiseParallel()
    if style in ("rowwise_split_input", "embedding_rowwise"):
        return RowwiseParallel(input_layouts=Replicate())
    if style == "replicated_with_grad_allreduce":
        # The weight whole (Replicate) on every rank, the input declared split along its first dimension (never the
        # normalized one): the norm computes locally, and autograd sums the weight's partial gradients.
        return SequenceParallel(sequence_dim=0, use_local_output=True)
    raise ValueError(f"no translation for tensor-parallel style {style!r}")


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Shard a ``TransformersModel`` (or a pipeline stage of one) over ``tp_mesh`` in place (module docstring)."""
    config = model.args.hf_config
    problems = tensor_parallel_problems(config)
    if problems:
        raise ConfigError(f"--parallelism.tensor_parallel_degree {tp_mesh.size()}: " + "; ".join(problems))
    layer_plan = {
        pattern.removeprefix(LAYERS): torch_style(style)
        for pattern, style in tp_plan(config).items()
        if pattern.startswith(LAYERS)
    }
    for layer in model.layers.values():
        parallelize_module(layer, tp_mesh, layer_plan)
    root_plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        root_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    if model.norm is not None:  # (a replicated DTensor: see the module docstring)
        root_plan["norm"] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_output=False
        )
    if model.output is not None:
        root_plan["output"] = ColwiseParallel(
            input_layouts=Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)
    # Tied embeddings: both sides are split by vocabulary rows (Shard(0)), so one DTensor serves both.
    if model.args.tie_word_embeddings and model.tok_embeddings is not None and model.output is not None:
        model.output.weight = model.tok_embeddings.weight
