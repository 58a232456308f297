"""Every place titanium raises a user error (``UserError`` and its kinds) is listed here: either checked before any
process starts (``titanium.preflight``, run by ``run_train.sh`` before torchrun, and first thing by
``titanium.train``) or kept for run time with the reason the config alone cannot decide it.

The test reads the source (no import of what it lists) and fails on a raise site in a function not listed: a new
check belongs in preflight when the config decides it (add it to a ``check_*`` function preflight calls, or to the
objective's ``check_config``), else here with its reason. Config loading (``titanium/config``) runs before preflight
and the tools (``titanium/tools``) are entry points of their own; neither is listed.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

USER_ERRORS = {
    "UserError",
    "ConfigError",
    "LoRAConfigError",
    "HFConfigError",
    "HFExportError",
    "CheckpointError",
    "HFCheckpointError",
    "TokenizerError",
    "DataError",
    "NonFiniteError",
}

PREFLIGHT = "preflight"
"""Checked before any process starts (called from titanium.preflight; some are also called again at run time, for
folders or models the trainer meets anyway)."""

DATA = "reads the data files (rows, columns, chat turns): their contents are not opened before start-up"
TOKENIZER = "reads the tokenizer file's contents (preflight only checks that it exists)"
DEVICE = "needs the device the process computes on (CUDA capability, kernels), known once it has its GPU"
RESUME = "reads this run's own checkpoints when it resumes (per-rank states of the layout that saved them)"
EXPORT = "writes an export at the end of training, from the model as trained"
HEADERS = "reads the safetensors headers of a folder (preflight reads its config.json)"
TOOL = "an argument of a tool (titanium/tools), an entry point of its own"
ENGINE_AGAIN = (
    "the engine's own guard for engines built directly (tests, a user's objective); titanium.preflight checks the "
    "same through check_vllm"
)

BACKEND_AGAIN = (
    "the transformers backend's own guard for models built directly; titanium.preflight refuses the same through "
    "ModelSpec.refusals (its tensor_parallel_problems)"
)
LM_EVAL = (
    "needs lm-eval and its task index (installed as an extra, imported when the evaluation is built; its task files "
    "are read there)"
)

RUN_TIME_CHECKS = {
    # ----- checked by titanium.preflight
    "titanium.preflight:start_model": PREFLIGHT,
    "titanium.preflight:check_model": PREFLIGHT,
    "titanium.model_builder:resolve_spec": PREFLIGHT,
    "titanium.models.transformers.hf:TransformersHFAdapter.from_hf_config": PREFLIGHT,
    "titanium.models.transformers.model:check_structure": PREFLIGHT,
    "titanium.objectives.online_dpo:check_pair_rows": PREFLIGHT,
    "titanium.checkpoint.hf:require_hf_adapter": PREFLIGHT,
    "titanium.checkpoint.hf:hf_model_args": PREFLIGHT,
    "titanium.checkpoint.hf:read_hf_config": PREFLIGHT,
    "titanium.models.decoder_adapter:DecoderHFAdapter.from_hf_config": PREFLIGHT,
    "titanium.models.llama3.hf:Llama3HFAdapter.from_hf_config": PREFLIGHT,
    "titanium.models.llama3.hf:scaling_from_hf": PREFLIGHT,
    "titanium.models.qwen3.hf:Qwen3HFAdapter.from_hf_config": PREFLIGHT,
    "titanium.models.reward_hf:SequenceClassificationAdapter.from_hf_config": PREFLIGHT,
    "titanium.parallel.dims:ParallelDims.from_config": PREFLIGHT,
    "titanium.parallel.dims:ParallelDims.check_model": PREFLIGHT,
    "titanium.parallel.dims:ParallelDims.check_experts": PREFLIGHT,
    "titanium.parallel.dims:ParallelDims.grad_accum_steps": PREFLIGHT,
    "titanium.moe_balance:check_moe_config": PREFLIGHT,
    "titanium.moe_balance:check_bias_reaches_hf": PREFLIGHT,
    "titanium.peft.lora:check_lora_config": PREFLIGHT,
    "titanium.peft.lora:apply_lora": PREFLIGHT,
    "titanium.peft.export:check_peft_loads": PREFLIGHT,
    "titanium.quantize.__init__:check_filters_match": PREFLIGHT,
    "titanium.quantize.schemes:quantized_layers": PREFLIGHT,
    "titanium.optim.in_backward:check_in_backward": PREFLIGHT,
    "titanium.checkpoint.hub:check_push": PREFLIGHT,
    "titanium.checkpoint.manager:check_checkpoint": PREFLIGHT,
    "titanium.model_setup:StartingWeights.check_evaluate_only": PREFLIGHT,
    "titanium.objectives.kd:teacher_source": PREFLIGHT,
    "titanium.objectives.kd:check_teacher_processor": PREFLIGHT,
    "titanium.rl.rewards.scores:scalar_head_source": PREFLIGHT,
    "titanium.rl.source:sharded_reward_models": PREFLIGHT,
    "titanium.inputs:_from_hf_folder": PREFLIGHT,
    "titanium.inputs:_check_same_tokenizer": PREFLIGHT,
    "titanium.peft.lora:peft_targets": PREFLIGHT,
    "titanium.peft.lora:check_peft_targets": PREFLIGHT,
    "titanium.objectives.grpo:check_pipeline_rows": PREFLIGHT,
    "titanium.objectives.reward:RewardObjective.check_config": PREFLIGHT,
    "titanium.objectives.dpo:DPOObjective.check_config": PREFLIGHT,
    "titanium.rl.source:check_source": PREFLIGHT,
    "titanium.objectives.reward:check_pair_rows": PREFLIGHT,
    "titanium.rl.rewards.functions:resolve_reward": PREFLIGHT,
    "titanium.rl.rewards.functions:_from_file": PREFLIGHT,
    "titanium.rl.rewards.functions:is_batched": PREFLIGHT,
    "titanium.rl.rewards.model_scorer:reward_model_config": PREFLIGHT,
    "titanium.rl.episodes:tool_schemas": PREFLIGHT,
    "titanium.models.transformers.image_feeds:_holder": PREFLIGHT,
    "titanium.models.transformers.image_feeds:image_feed": PREFLIGHT,
    "titanium.models.transformers.language:language_model": PREFLIGHT,
    "titanium.models.transformers.vision:vision_parts.visit": PREFLIGHT,
    "titanium.models.transformers.vision:ImageTextModel._language_parts": PREFLIGHT,
    "titanium.peft.vision_freeze:VisionFreezeConverter.convert": PREFLIGHT,
    "titanium.rl.env.registry:environment_spec": PREFLIGHT,
    "titanium.rl.env.registry:_environment_class": PREFLIGHT,
    "titanium.rl.env.registry:_factory": PREFLIGHT,
    "titanium.rl.env.adapters:build": PREFLIGHT,
    "titanium.rl.env.adapters:action_text_field": PREFLIGHT,
    "titanium.rl.tools.loading:load_function": PREFLIGHT,
    "titanium.rl.tools.loading:_file_module": PREFLIGHT,
    "titanium.rl.tools.loading:reference": PREFLIGHT,
    "titanium.rl.tools.schema:json_schema": PREFLIGHT,
    "titanium.rl.tools.schema:_type_schema": PREFLIGHT,
    "titanium.generation.vllm_engine:check_vllm": PREFLIGHT,
    "titanium.generation.vllm_engine:check_batch_budget": PREFLIGHT,
    "titanium.generation.vllm_engine:check_cpu_head_dim": PREFLIGHT,
    "titanium.parallel.pipeline:split_layers": PREFLIGHT,
    "titanium.parallel.pipeline:check_untied": PREFLIGHT,
    "titanium.parallel.pipeline:check_microbatches": PREFLIGHT,
    # ----- left for run time
    "titanium.checkpoint.hf:HFCheckpoint.open": HEADERS,
    "titanium.checkpoint.hf:HFCheckpoint._open": HEADERS,
    "titanium.checkpoint.hf:HFCheckpoint.read": "reads tensor data",
    "titanium.checkpoint.hf:check_hf_keys": "compares the safetensors headers with the built model's state dict",
    "titanium.checkpoint.hf:load_hf_weights": "reads tensor data into the built (sharded) model",
    "titanium.checkpoint.hf:_FileWriter.finish": EXPORT,
    "titanium.checkpoint.hf:save_hf_weights": EXPORT,
    "titanium.checkpoint.hub:upload": "needs the network, after the export is written",
    "titanium.checkpoint.manager:CheckpointManager._keys_in_checkpoint": RESUME,
    "titanium.checkpoint.manager:CheckpointManager._load": RESUME,
    "titanium.checkpoint.manager:CheckpointManager._resume_step": RESUME,
    "titanium.checkpoint.manager:check_model_fits": "compares a checkpoint's .metadata with the built model's state",
    "titanium.checkpoint.manager:load_model_weights": "reads a checkpoint into a built (frozen) model",
    "titanium.data.preference:PreferenceDataset.__init__": DATA,
    "titanium.data.prompts:PromptDataset.__init__": DATA,
    "titanium.data.sft:SFTDataset.__init__": DATA,
    "titanium.data.text:RowReader.__init__": DATA,
    "titanium.data.text:RowReader._load_position": RESUME,
    "titanium.data.text:RowReader._rows": DATA,
    "titanium.data.text:check_same_dp_world": RESUME,
    "titanium.data.text:refuse_images": DATA + " (a row's images, given to a text model)",
    "titanium.data.text:open_stream": DATA,
    "titanium.data.text:read_stream": DATA,
    "titanium.data.text:resolve_sources": DATA,
    "titanium.data.unpaired:UnpairedDataset.__init__": DATA,
    "titanium.evaluation.exact_match:load_eval_samples": DATA,
    "titanium.objectives.dpo_reference:ReferenceCache.lookup": DATA + " (a precomputed reference per row)",
    "titanium.data.tokenizer:HFTokenizer._read_config": TOKENIZER,
    "titanium.data.tokenizer:HFTokenizer._special_id": TOKENIZER,
    "titanium.data.tokenizer:load_bpe_ranks": TOKENIZER,
    "titanium.data.tokenizer:_ecosystem_backend": TOKENIZER,
    "titanium.checkpoint.hf:check_tokenizer_fits": TOKENIZER + " (its size against the model's embedding)",
    "titanium.data.kinds:detect_kind": DATA,
    "titanium.data.vision_sft:VisionSFTDataset.__init__": DATA + " (the kind --data.kind auto reads from the rows)",
    "titanium.models.transformers.hf:TransformersHFAdapter.to_hf": EXPORT,
    "titanium.models.transformers.vision:checkpoint_prefixes": HEADERS,
    "titanium.data.kinds:first_row": DATA,
    "titanium.rl.rewards.model_scorer:RewardModelScorer.load": (
        "compares the reward model with the tokenizer (pad id, vocabulary; preflight checked its folder and family)"
    ),
    "titanium.rl.rewards.model_scorer:_own_reader.read": "renders a rollout's conversation with the reward model's "
    "own chat template (whether a conversation comes depends on the data)",
    "titanium.rl.rewards.functions:exact_match": DATA + " (a row without a reference answer)",
    "titanium.rl.rewards.math_verify:math_verify": DATA + " (a row without a reference answer)",
    "titanium.rl.source:RolloutSource._episode_runner": DATA + " (whether prompts come with a chat template)",
    "titanium.rl.turns:TurnRenderer.suffix": TOKENIZER + " (whether its chat template appends turns to a prefix)",
    "titanium.rl.rewards.functions:_finite": "checks what a reward function returns for a rollout",
    "titanium.rl.rewards.functions:RewardSet._checked": "checks what a batched reward function returns",
    "titanium.guards:StepGuard.check": "a non-finite loss or gradient met during training",
    "titanium.fault_tolerance:FaultTolerance.__init__": "reads the launcher's environment of this worker (torchrun's "
    "store address), which preflight's process does not have",
    "titanium.generation.vllm_engine:engine_group": (
        "--rollout.server_per node counts the processes torchrun started on this machine (LOCAL_WORLD_SIZE), known "
        "in the worker; the colocated split is checked by preflight (check_vllm)"
    ),
    "titanium.generation.vllm_engine:VLLMEngine.__init__": ENGINE_AGAIN + " (and vLLM failing to import)",
    "titanium.generation.vllm_server:check_server": ENGINE_AGAIN,
    "titanium.model_builder:ModelBuilder.__post_init__": DEVICE + " (FlexAttention has no CPU backward)",
    "titanium.model_builder:ModelBuilder._load": "a family without a Hugging Face adapter asked to load a folder by "
    "code that builds models directly (preflight refuses it for the job: require_hf_adapter)",
    "titanium.optim.optimizer:optimizer_factory": DEVICE,
    "titanium.quantize.float8:check_float8_hardware": DEVICE,
    "titanium.quantize.schemes:check_device": DEVICE,
    "titanium.parallel.compile:check_compile": DEVICE,
    "titanium.parallel.parallelize:parallelize_decoder": "the model's own modules under the built device mesh",
    "titanium.parallel.pipeline:Pipeline.build_schedule": (
        "what torch's schedule class refuses when it is made from the built stages (e.g. too few microbatches)"
    ),
    "titanium.peft.nf4:to_nf4": "quantizes the materialized weights (the shard split of each weight as FSDP makes it)",
    "titanium.checkpoint.quantized_export:export_quantized_hf": (
        TOOL + " (convert quantize: --model, --scheme, --dtype)"
    ),
    "titanium.models.hf_adapter:HFAdapter.to_hf": "names the weights of a built model (a weight sync or an export)",
    "titanium.objectives.losses.cross_entropy:TokenCrossEntropy.__init__": (
        "the objective's loss, made when the objective is built (the config validation refuses the same range)"
    ),
    "titanium.objectives.losses.cross_entropy:plain_projection_weight": (
        "the class of the output layer the loss receives after the converters, met at the first loss that projects "
        "by hand"
    ),
    "titanium.objectives.kto:KTOObjective.__init__": "an objective built outside titanium.train without model handles",
    "titanium.models.transformers.parallelize:apply_tensor_parallel": BACKEND_AGAIN,
    "titanium.models.transformers.parallelize:replicate_the_rest": BACKEND_AGAIN,
    "titanium.evaluation.harness:require_lm_eval": LM_EVAL,
    "titanium.evaluation.harness:task_manager": LM_EVAL,
    "titanium.evaluation.harness:run_tasks": LM_EVAL,
    "titanium.evaluation.lm_eval:build_lm_eval": LM_EVAL,
    "titanium.evaluation.lm:TitaniumLM.apply_chat_template": "renders a task's requests with the chat template "
    "(the template and the requests are known when the evaluation runs)",
    "titanium.evaluation.lm:_GenerationSettings.of": "reads a task's generation settings from lm-eval's task files",
    "titanium.trainer:Trainer.evaluate_only": "whether an evaluation is on is known once each is built (an evaluation "
    "of your own decides from its own section)",
}


def raise_sites() -> dict[str, list[int]]:
    """``module:function`` -> lines of every ``raise`` of a user error under titanium/, outside config and tools."""
    sites: dict[str, list[int]] = {}
    for path in sorted((REPO / "titanium").rglob("*.py")):
        relative = path.relative_to(REPO)
        if relative.parts[1] in ("config", "tools"):
            continue
        module = ".".join(relative.with_suffix("").parts)

        def visit(node: ast.AST, scope: list[str], module: str = module) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(child, [*scope, child.name])
                    continue
                if isinstance(child, ast.Raise) and child.exc is not None:
                    target = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                    name = getattr(target, "id", getattr(target, "attr", None))
                    if name in USER_ERRORS:
                        sites.setdefault(f"{module}:{'.'.join(scope)}", []).append(child.lineno)
                visit(child, scope)

        visit(ast.parse(Path(path).read_text()), [])
    return sites


def test_every_user_error_is_checked_before_start_up_or_says_why_not():
    sites = raise_sites()
    unlisted = {site: lines for site, lines in sites.items() if site not in RUN_TIME_CHECKS}
    assert not unlisted, (
        f"user errors raised in functions this table does not list: {unlisted}. If the config alone decides the "
        "check, make titanium.preflight run it (a check_* function it calls, or the objective's check_config) and "
        "list it as PREFLIGHT; else list it with the reason it needs the model, the data or the device"
    )
    gone = sorted(set(RUN_TIME_CHECKS) - set(sites))
    assert not gone, f"listed but no longer raising a user error (remove them): {gone}"
    assert all(reason for reason in RUN_TIME_CHECKS.values())
