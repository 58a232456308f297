"""Regional compilation: one torch.compile per transformer block, and the AsyncTP switch."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanium.config.loader import ConfigError
from titanium.config.sections import ActivationCheckpointSection, CompileSection


def apply_compile(model: nn.Module) -> None:
    """Compile each block of ``model.layers`` with fullgraph=True, in place.

    Identical blocks share one compiled graph, so compile time does not grow with depth, and
    FSDP's hooks stay outside the graphs (its communication is not traced). Apply after
    activation checkpointing (the wrapper is compiled with the block) and before FSDP.
    ``nn.Module.compile`` keeps the block itself in the model (no ``_orig_mod`` wrapper), so
    parameter names, and everything that maps them (checkpoints, Hugging Face, LoRA), do not
    depend on compilation.

    A block with a Mixture of Experts is compiled by parts instead: its attention, router and shared
    experts. The routing between them stays eager, for two reasons: the token counts it records are a
    side effect that dynamo refuses inside a checkpointed region, and the group sizes (the padded GEMM on
    CPU, expert parallelism's all-to-all) are a host sync that would break the graph anyway.
    """
    for block in model.layers.values():
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        moe = getattr(inner, "moe", None)
        if moe is None:
            block.compile(fullgraph=True)
            continue
        for part in (inner.attention, moe.router, moe.shared_experts):
            if part is not None:
                part.compile(fullgraph=True)


def check_compile(
    cfg: CompileSection, ac: ActivationCheckpointSection, tensor_parallel: bool, device_type: str
) -> None:
    """The compile settings a plan on ``device_type`` cannot run (the trainer and the dry run check the same)."""
    if cfg.enable_async_tensor_parallel and device_type != "cuda":
        raise ConfigError(
            f"--compile.enable_async_tensor_parallel needs CUDA GPUs (symmetric memory); this run is on "
            f"{device_type}: drop the flag"
        )
    whole_block_ac = ac.mode == "full" or (ac.mode == "selective" and ac.selective_ac_option != "op")
    if cfg.enable and tensor_parallel and device_type == "cpu" and whole_block_ac:
        # torch 2.13 on CPU: AOT autograd fails to save a DTensor block input for recomputation
        # ("expected all tensors_saved_with_vc_check to be Tensors ... DeviceMesh").
        raise ConfigError(
            "--compile.enable with tensor parallelism and whole-block activation checkpointing fails on CPU; "
            "use --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op, "
            "or turn one of them off"
        )


def enable_async_tensor_parallel(tp_mesh: DeviceMesh) -> None:
    """Let inductor split TP all-gathers / reduce-scatters into chunks that overlap the matmuls.

    Needs CUDA (symmetric memory) and compiled blocks (``check_compile``).
    """
    import torch._inductor.config as inductor_config
    import torch.distributed._symmetric_memory as symm_mem

    inductor_config._micro_pipeline_tp = True
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # newer torch enables symmetric memory on demand
        enable(tp_mesh.get_group().group_name)
