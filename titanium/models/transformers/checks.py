"""What a backend model cannot do of a job's use of it, said before any process group exists (``ModelSpec.refusals``).

The layout needs the config's plans (``plans.py``); context and expert parallelism are not translated for backend
models yet; and a model that runs its own attention (``support.py``) cannot take what only titanium's attention
carries: shared-prompt rows and titanium's KV cache, and, where some of its layers are no attention at all,
packed documents (its own attention keeps packed documents apart by their restarting positions, as
``transformers`` does for packed rows; a linear-attention layer would mix them).
"""

from __future__ import annotations

import torch

from titanium.models.spec import ModelUse
from titanium.models.transformers.args import TransformersArgs
from titanium.models.transformers.plans import pipeline_problems, tensor_parallel_problems


def backend_refusals(args: TransformersArgs, use: ModelUse) -> list[str]:
    """Each thing of ``use`` the model of ``args`` cannot do, as a message naming the flag to change."""
    from titanium.models.transformers.model import TransformersModel

    config = args.hf_config
    problems = []
    if use.tensor_parallel > 1:
        flag = f"--parallelism.tensor_parallel_degree {use.tensor_parallel}"
        problems += [f"{flag}: {p}" for p in tensor_parallel_problems(config)]
    if use.pipeline_parallel > 1:
        flag = f"--parallelism.pipeline_parallel_degree {use.pipeline_parallel}"
        problems += [f"{flag}: {p}" for p in pipeline_problems(config)]
    if use.context_parallel > 1:
        problems.append(
            f"--parallelism.context_parallel_degree {use.context_parallel}: context parallelism is not implemented for "
            "the transformers backend yet"
        )
    if use.expert_parallel > 1:
        problems.append(
            f"--parallelism.expert_parallel_degree {use.expert_parallel}: the transformers backend runs the model's "
            "own MoE blocks, which expert parallelism does not split yet"
        )
    with torch.device("meta"):
        model = TransformersModel(args)
    if model.fallback_reasons:
        own = f"{config.model_type} runs its own attention ({'; '.join(model.fallback_reasons)})"
        if use.shared_prompts:
            problems.append(f"{own}, which cannot share a prompt between two responses: set --dpo.no_share_prompt")
        if use.kv_cache_decoding:
            problems.append(
                f"{own}, which titanium's sampler cannot decode with its KV cache: use --rollout.engine vllm (and "
                "--eval.interval 0)"
            )
        if use.packing and model.mixes_documents:
            section, key = use.packing.removeprefix("--").split(".", 1)
            problems.append(f"{use.packing}: {own}, whose layers would mix packed samples; set --{section}.no_{key}")
    return problems
