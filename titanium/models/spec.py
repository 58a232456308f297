"""What the rest of titanium needs to know about a model family, in one typed record."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from torch import nn

from titanium.models.common.decoder import FamilyArgs
from titanium.models.hf_adapter import HFAdapter

A = TypeVar("A", bound=FamilyArgs)


@dataclass(frozen=True)
class ModelUse:
    """How a job will use its model: what a spec's ``refusals`` check before any process group exists."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    expert_parallel: int = 1
    hf_checkpoint: bool = False
    """The job reads or writes the model's Hugging Face checkpoint (``initial_load_in_hf``, ``last_save_in_hf``)."""
    packing: str = ""
    """The flag that packs several samples per row, whose attention must stay apart (``--sft.packing``); empty:
    no packing."""
    shared_prompts: bool = False
    """Rows hold a prompt once with two responses that each see it and not each other (DPO's share_prompt)."""
    compiled_decoding: bool = False
    """titanium's rollout engine runs its decode step through ``torch.compile`` (``--rollout.compile``)."""
    vllm_rollouts: bool = False
    """The job samples from vLLM (``--rollout.engine vllm``), which builds the architecture with its own code."""
    score_head: bool = False
    """The job builds the model with a scalar score head instead of its LM head (a reward model, PPO's value model)."""
    split_decoding: int = 1
    """Ranks titanium's rollout engine splits its decoding copy over (``--rollout.tensor_parallel_size``)."""
    load_balance: str = "none"
    """How an MoE model's routing is balanced while it trains (``--moe.load_balance``)."""


TensorParallelPlan = Callable[[nn.Module, Any, bool], None]
"""``(model or pipeline stage, tp_mesh, loss_parallel)``: shard the model's modules over ``tp_mesh`` (a
DeviceMesh; models never import torch.distributed outside their parallelize.py) in place."""


@dataclass(frozen=True)
class ModelSpec(Generic[A]):
    """A model family as the builder sees it, so nothing else imports a model directly."""

    name: str
    """Registry key, matched against ``[model] name`` in the job config."""
    model_cls: Callable[[A], nn.Module]
    """Builds the model from its args, on whatever device is current (the builder uses meta)."""
    flavors: Mapping[str, A]
    """Size presets, flavor name -> args; ``[model] flavor`` picks one."""
    flops_per_token: Callable[[A, int], float]
    """``(args, seq_len) -> training FLOPs per token`` (forward + backward), for MFU; never allocates."""
    tp_plan: TensorParallelPlan | None = None
    """The family's tensor-parallel plan (``models/<family>/parallelize.py``); None: no tensor parallelism."""
    hf_adapter: HFAdapter | None = None
    """Converts weights and config.json to and from the Hugging Face format; None if absent."""
    refusals: Callable[[A, ModelUse], list[str]] | None = None
    """``(args, use) -> problems``: what this model cannot do of ``use`` (each problem one message naming the flag
    to change), checked before any process group exists; None: nothing beyond the layout's own checks."""
    chat_template: str | None = None
    """The built-in chat format (``--chat.chat_template`` value) of the family's instruct models, used by ``auto``
    when the tokenizer brings no template of its own; None: the tokenizer's template is required."""
