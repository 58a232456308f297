"""A backend model's tensor-parallel plan: its config's ``base_model_tp_plan`` in torch's parallel styles.

The plan's styles map onto torch's as ``transformers`` defines them: ``colwise`` splits a linear layer by output
rows and leaves its output split (the heads or the MLP's hidden width per rank), ``rowwise`` splits it by input
columns and all-reduces its output, ``colwise_gather_output`` / ``rowwise_split_input`` do the same with whole
activations on both sides (OLMo 2 normalizes the whole query), and ``replicated_with_grad_allreduce`` (Qwen3's
per-head q/k norms, which see only the rank's heads) keeps a norm's weight whole and sums its gradient over the
ranks.

Sequence parallelism, as in the native plans: between the mixers (the layer's children that hold the plan's split
layers: its attention and MLP) the hidden states stay split along the sequence, as plain local tensors, so the
model's own code between them (residual adds, its multipliers) runs on each rank's part untouched; each mixer
gathers them whole first (``GatherSequence``), its row-wise layer reduce-scatters its output back, and the layer's
norms (its other children with parameters) run on the parts with their weights whole and their gradients summed
over the ranks (torch's ``SequenceParallel``). A layer holding parameters anywhere else is not split so, nor is an
image-text model (it places its image features into the whole sequence's embeddings): the model then runs with
whole activations between layers (logged).

Around the plan, as for the native families: the embedding and the LM head are split by vocabulary (one DTensor
when they are tied), with loss parallel the logits stay split by vocabulary into the loss, and the final norm's
output is a DTensor (split along the sequence, or whole without sequence parallelism), so a loss that projects by
itself (chunked cross-entropy) sums the hidden states' partial gradients over the ranks; a score head scores the
gathered sequence (``score_head_plan``). An image-text model's vision tower and projector are not split: every rank
computes them whole, on plain tensors, and hands the language model the whole image features
(``WholeOnPlainTensors``).
"""

from __future__ import annotations

import fnmatch
import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titanium.config.loader import ConfigError
from titanium.models.common.parallelize import score_head_plan
from titanium.models.transformers.plans import tensor_parallel_problems, tp_plan

LAYERS = "layers.*."

logger = logging.getLogger(__name__)


def torch_style(style: str, split_sequence: bool = False) -> ParallelStyle:
    """The torch style of one ``transformers`` style name (``plans.TRANSLATED_STYLES``); ``split_sequence``: under
    sequence parallelism, where a row-wise layer (a mixer's last) reduce-scatters its output along the sequence."""
    out = Shard(1) if split_sequence else Replicate()
    if style == "colwise":
        return ColwiseParallel()
    if style == "colwise_gather_output":
        return ColwiseParallel(output_layouts=Replicate())
    if style == "rowwise":
        return RowwiseParallel(output_layouts=out)
    if style in ("rowwise_split_input", "embedding_rowwise"):
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=out)
    if style == "replicated_with_grad_allreduce":
        # The weight whole (Replicate) on every rank, the input declared split along its first dimension (never the
        # normalized one): the norm computes locally, and autograd sums the weight's partial gradients.
        return SequenceParallel(sequence_dim=0, use_local_output=True)
    raise ValueError(f"no translation for tensor-parallel style {style!r}")


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Shard a ``TransformersModel`` (or a pipeline stage of one) over ``tp_mesh`` in place (module docstring)."""
    config = model.args.text_config
    problems = tensor_parallel_problems(config, model)
    if problems:
        raise ConfigError(f"--parallelism.tensor_parallel_degree {tp_mesh.size()}: " + "; ".join(problems))
    plan = {
        pattern.removeprefix(LAYERS): style for pattern, style in tp_plan(config).items() if pattern.startswith(LAYERS)
    }
    layer_parts = [sequence_parallel_parts(layer, plan) for layer in model.layers.values()]
    split = bool(layer_parts) and all(parts is not None for parts in layer_parts) and not model.args.reads_images
    if not split:  # (an image-text model places its image features into the whole sequence's embeddings)
        why = "an image-text model" if model.args.reads_images else "a layer holds parameters outside its mixers"
        logger.info("tensor parallel without sequence parallelism: %s", why)
    layer_plan = {name: torch_style(style, split) for name, style in plan.items()}
    for layer, parts in zip(model.layers.values(), layer_parts, strict=True):
        parallelize_module(layer, tp_mesh, layer_plan)
        if split:
            mixers, norms = parts
            for name in mixers:
                parallelize_module(layer.get_submodule(name), tp_mesh, GatherSequence())
            for name in norms:
                parallelize_module(layer.get_submodule(name), tp_mesh, SequenceParallel(use_local_output=True))
    between = Shard(1) if split else Replicate()
    root_plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        root_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if split and model.norm is not None:
        root_plan["norm"] = SequenceParallel()  # (its output a DTensor split along the sequence, as the native plans')
    if model.output is not None and not model.args.score_head:
        root_plan["output"] = ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)
    if split and model.output is not None and model.args.score_head:
        score_head_plan(model.output, tp_mesh)
    for name in getattr(model, "vision_names", ()):  # (an image-text model's vision tower and projector)
        parallelize_module(getattr(model, name), tp_mesh, WholeOnPlainTensors())
    replicate_the_rest(model, tp_mesh)
    # Tied embeddings: both sides are split by vocabulary rows (Shard(0)), so one DTensor serves both.
    if model.args.tie_word_embeddings and model.tok_embeddings is not None and model.output is not None:
        model.output.weight = model.tok_embeddings.weight


def sequence_parallel_parts(layer: nn.Module, plan: dict[str, str]) -> tuple[list[str], list[str]] | None:
    """A layer's mixers (the children holding the plan's split layers: its attention and MLP) and norms (the children
    with parameters and no sublayers), when those are all its parameters; None otherwise (sequence parallelism would
    not know how to place the rest)."""
    mixers, norms = [], []
    for name, child in layer.named_children():
        if any(fnmatch.fnmatchcase(f"{name}.{sub}", pattern) for sub, _ in child.named_modules() for pattern in plan):
            mixers.append(name)
        elif next(child.children(), None) is None and next(child.parameters(recurse=False), None) is not None:
            norms.append(name)
        elif next(child.parameters(), None) is not None:
            return None
    return (mixers, norms) if mixers else None


class GatherSequence(ParallelStyle):
    """A mixer (attention, MLP) under sequence parallelism: its hidden states, which arrive split along the sequence
    (first positional argument, else the ``hidden_states`` keyword, as the model's code passes them), gathered whole
    before it; their gradient is reduce-scattered back."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(value: torch.Tensor) -> torch.Tensor:
            split = DTensor.from_local(value, device_mesh, [Shard(1)], run_check=False)
            return split.redistribute(device_mesh, [Replicate()]).to_local()

        def before(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (gather(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}

        module.register_forward_pre_hook(before, with_kwargs=True)
        return module


class ReplicatedParallel(ParallelStyle):
    """A module every rank computes whole: its own parameters become replicated DTensors (so the optimizer sees one
    kind of parameter, and clipping counts them once), its tensor inputs replicated DTensors, and its outputs plain
    tensors again (``use_local_output``) or replicated DTensors. Each rank computes the whole gradient: nothing is
    reduced."""

    def __init__(self, *, use_local_output: bool = True) -> None:
        super().__init__()
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            replicated = DTensor.from_local(param, device_mesh, [Replicate()], run_check=False)
            module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))

        def whole(value: object) -> object:
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                return DTensor.from_local(value, device_mesh, [Replicate()], run_check=False)
            return value

        def local(value: object) -> object:
            return value.to_local() if isinstance(value, DTensor) else value

        def before(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return tuple(whole(a) for a in args), {k: whole(v) for k, v in kwargs.items()}

        def after(_: nn.Module, args: tuple, output: object) -> object:
            if not self.use_local_output:
                return output
            return tuple(local(o) for o in output) if isinstance(output, tuple) else local(output)

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after)
        return module


class WholeOnPlainTensors(ParallelStyle):
    """A module (with all its submodules) every rank computes whole, as one process would, on plain tensors: its
    parameters become replicated DTensors (the optimizer, gradient clipping and checkpoints see one kind of
    parameter, counted once), and for each forward the module holds their local tensors instead, so its own code
    runs untouched (no DTensor op coverage needed: an image-text model's vision tower and projector). Its inputs are
    the same on every rank, so each rank computes the whole gradient, which reaches the replicated parameter through
    ``to_local``: nothing is reduced."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        replicated: dict[int, nn.Parameter] = {}  # (a parameter two submodules share stays one)
        for sub in module.modules():
            for name, param in list(sub.named_parameters(recurse=False)):
                if id(param) not in replicated:
                    whole = DTensor.from_local(param, device_mesh, [Replicate()], run_check=False)
                    replicated[id(param)] = nn.Parameter(whole, requires_grad=param.requires_grad)
                sub.register_parameter(name, replicated[id(param)])
        held: list[tuple[nn.Module, str, nn.Parameter]] = []

        def before(root: nn.Module, _: tuple) -> None:
            for sub in root.modules():
                for name, param in sub._parameters.items():
                    if isinstance(param, DTensor):
                        held.append((sub, name, param))
                        sub._parameters[name] = param.to_local()

        def after(*_: object) -> None:
            while held:
                sub, name, param = held.pop()
                sub._parameters[name] = param

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after, always_call=True)
        return module


def replicate_the_rest(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Every module the plan left with plain parameters of its own (norms, scalars) computed whole on every rank
    (``ReplicatedParallel``); the final norm's output stays a replicated DTensor (see the module docstring). A module
    that also has children is refused: its forward would mix its replicated values with the children's plain ones."""
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if not isinstance(p, DTensor)]
        if not own:
            continue
        if next(module.children(), None) is not None:
            raise ConfigError(
                f"--parallelism.tensor_parallel_degree {tp_mesh.size()}: {name} ({type(module).__name__}) holds "
                "parameters of its own beside its sublayers, which titanium's translation of the model's plan does "
                "not split; use tensor_parallel_degree 1"
            )
        parallelize_module(module, tp_mesh, ReplicatedParallel(use_local_output=module is not model.norm))
