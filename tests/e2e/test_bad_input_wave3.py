"""Bad input aimed at the newest features (MoE/EP, Hugging Face configs of every family, rollout engines, GRPO
variants, PPO, KD, KTO, reward models, DoRA, QAT/float8 filters, quantized export, the tools): each case runs as a
process of its own and must end with exit code 2, one line that starts with ``titanium:`` (the tools: their
``titanium.tools.<tool>: error:``) naming the thing and the fix, and no traceback.

The training cases run ``python -m titanium.preflight`` (what ``run_train.sh`` runs before torchrun; the world size
from WORLD_SIZE): every one of them is decided by the config and the files it names, so it must be refused before
any worker starts. The tools run their own ``main``. All cases of the table run in one launch of
``tests/e2e/case_runner.py`` (torch imported once, one forked process per case).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, env
from titanium.checkpoint.hf import save_hf_weights
from titanium.models import get_model_spec

TRAIN = ("--job.no_print_config", "--checkpoint.no_enable")
DEBUG = ("--job.config_file", "train_configs/debug_model.toml", *TRAIN, "--training.seq_len", "64")
GRPO = ("--job.config_file", "train_configs/debug_grpo.toml", *TRAIN, "--checkpoint.initial_load_path", "")
PPO = ("--job.config_file", "train_configs/debug_ppo.toml", *TRAIN, "--checkpoint.initial_load_path", "")
KD = ("--job.config_file", "train_configs/debug_kd.toml", *TRAIN, "--checkpoint.initial_load_path", "")
KTO = ("--job.config_file", "train_configs/debug_kto.toml", *TRAIN, "--checkpoint.initial_load_path", "")
REWARD = ("--job.config_file", "train_configs/debug_reward.toml", *TRAIN)
VLM = ("--job.config_file", "train_configs/debug_vlm_sft.toml", *TRAIN)
VLM_FOLDER = "assets/hf_configs/tiny-gemma3-vlm"
DPO_DATA = "assets/tasks/arithmetic/preference_test.jsonl"
DEBUG_TOKENIZER = "assets/tokenizer/titanium_debug.tiktoken"
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [4.0] * 16, "factor": 32.0}


def hf_start(folder: str) -> tuple[str, ...]:
    return ("--checkpoint.initial_load_path", folder, "--checkpoint.initial_load_in_hf")


@dataclass(frozen=True)
class Case:
    name: str
    argv: tuple[str, ...]
    """``{name}`` stands for the folder ``folders`` made under that name."""
    message: str
    module: str = "titanium.preflight"
    world: int = 1
    needs_no_cuda: bool = False
    env: dict[str, str] = field(default_factory=dict)


FAMILY_FEATURES = [
    ("llama3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling {{'rope_type': 'yarn'"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window = true is not supported"),
    ("mistral", {"attention_bias": True}, "attention_bias = true is not supported"),
    ("qwen3", {"attention_bias": True}, "attention_bias = true is not supported"),
    ("qwen3_moe", {"shared_expert_intermediate_size": 512}, "shared_expert_intermediate_size = 512"),
    ("gemma2", {"attn_logit_softcapping": None}, "attn_logit_softcapping is missing or null"),
    ("phi3", {"rope_scaling": LONGROPE, "max_position_embeddings": 131072}, "rope_scaling type 'longrope'"),
]
"""A feature each family's titanium model does not implement, in that family's config.json."""

CASES = [
    # ----- image-text models (issue 41, item 8)
    Case(
        "vlm_folder_without_its_processor",
        (*VLM, "--model.hf_config", "{vlm_no_processor}", "--tokenizer.path", VLM_FOLDER),
        "--model.hf_config {vlm_no_processor}: the model reads images, and transformers' AutoProcessor cannot load its "
        "processor from the folder",
    ),
    Case(
        "vlm_folder_for_a_text_family",
        (*VLM, "--model.name", "gemma2"),
        f"--model.hf_config: {VLM_FOLDER}/config.json: model_type 'gemma3' is not a gemma2 checkpoint",
    ),
    Case(
        "vision_freezing_on_a_text_model",
        (*DEBUG, "--vision.freeze_vision_tower"),
        "--vision.freeze_vision_tower / --vision.freeze_projector: the model reads no images",
    ),
    # ----- MoE / expert parallelism, and the shape of a Hugging Face start folder
    Case(
        "moe_hf_ep_does_not_divide_the_experts",
        (*DEBUG, "--model.name", "qwen3_moe", *hf_start("{qwen3_moe}"), "--parallelism.expert_parallel_degree", "3"),
        "--parallelism.expert_parallel_degree 3 must divide the 8 experts of qwen3_moe from {qwen3_moe}/config.json",
        world=6,
    ),
    Case(
        "moe_ep_on_a_dense_hf_model",
        (*DEBUG, *hf_start("{llama3}"), "--parallelism.expert_parallel_degree", "2"),
        "--parallelism.expert_parallel_degree 2: llama3 from {llama3}/config.json is a dense model",
        world=2,
    ),
    Case(
        "hf_start_of_another_family",
        (*DEBUG, "--model.name", "llama3", *hf_start("{qwen3}")),
        "--model.name llama3 disagrees with {qwen3}/config.json (model_type 'qwen3': titanium's qwen3); leave "
        "--model.name out (the folder says it)",
    ),
    Case(
        "hf_shape_against_tensor_parallel",
        (*DEBUG, "--model.name", "qwen3", *hf_start("{qwen3}"), "--parallelism.tensor_parallel_degree", "3"),
        "--parallelism.tensor_parallel_degree 3 must divide",
        world=3,
    ),
    *(
        Case(
            f"hf_{family}_{next(iter(change))}", (*DEBUG, "--model.name", family, *hf_start(f"{{{family}_bad}}")), text
        )
        for family, change, text in FAMILY_FEATURES
    ),
    # ----- converters, checked on the model built on meta: LoRA, DoRA, QAT, float8
    Case(
        "lora_experts_of_a_dense_model",
        (*DEBUG, "--lora.rank", "4", "--lora.target_modules", "experts"),
        "--lora.target_modules: the model has no MoE experts named experts",
    ),
    Case(
        "dora_with_qat",
        (*DEBUG, "--lora.rank", "4", "--lora.use_dora", "--qat.enable"),
        "--lora.use_dora: 'layers.0.attention.wq' is a FakeQuantizedLinear (QAT); DoRA normalizes the plain weight",
    ),
    Case(
        "dora_on_experts",
        (*DEBUG, "--model.name", "qwen3_moe", "--model.flavor", "debugmodel_moe", "--lora.rank", "4")
        + ("--lora.target_modules", "experts", "--lora.use_dora"),
        "--lora.target_modules experts: the experts' adapters are a weight update",
    ),
    Case(
        "lora_on_a_tied_output",
        (*DEBUG, "--model.name", "qwen3", "--lora.rank", "4", "--lora.target_modules", "output"),
        "--lora.target_modules: 'output' shares its weight with another layer (tied embeddings)",
    ),
    Case(
        "lora_adapter_that_peft_would_load_onto_the_experts",
        (*DEBUG, "--model.name", "qwen3_moe", *hf_start("{qwen3_moe_dense_layer}"), "--lora.rank", "4")
        + ("--lora.target_modules", "attention", "mlp"),
        "cannot export the LoRA adapters of the dense MLP layers (down_proj, gate_proj, up_proj) of this qwen3_moe "
        "model in PEFT layout",
    ),
    Case(
        "pipeline_split_point_past_the_last_block",
        (*DEBUG, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_split_points")
        + ("layers.9",),
        "--parallelism.pipeline_parallel_split_points: 'layers.9' is not a block; valid: layers.1 .. layers.5",
        world=2,
    ),
    Case(
        "pipeline_with_tied_embeddings_from_a_hf_folder",
        (*DEBUG, "--model.name", "qwen3", *hf_start("{qwen3}"), "--parallelism.pipeline_parallel_degree", "2"),
        "--parallelism.pipeline_parallel_degree > 1 with tied embeddings",
        world=2,
    ),
    Case(
        "qat_group_size_does_not_divide",
        (*DEBUG, "--qat.enable", "--qat.group_size", "48"),
        "--qat.group_size 48 does not divide the 256 inputs of layers.0.attention.wq",
    ),
    Case(
        "qat_filter_matches_nothing",
        (*DEBUG, "--qat.enable", "--qat.filter_fqns", "lm_head"),
        "--qat.filter_fqns: 'lm_head' matches no linear layer of the model",
    ),
    Case(
        "float8_filter_matches_nothing",
        (*DEBUG, "--float8.enable", "--float8.emulate", "--float8.filter_fqns", "output", "down_proj"),
        "--float8.filter_fqns: 'down_proj' matches no linear layer of the model",
    ),
    # ----- GRPO and the rollout engines
    Case(
        "vllm_split_does_not_divide_the_processes",
        (*GRPO, "--rollout.engine", "vllm", "--rollout.tensor_parallel_size", "2"),
        "--rollout.tensor_parallel_size 2 shares each vLLM engine between 2 consecutive training processes: that "
        "must divide their number (3",
        world=3,
    ),
    Case(
        "vllm_batch_budget_below_prompt_and_answer",
        (*GRPO, "--rollout.engine", "vllm", "--rollout.max_num_batched_tokens", "32"),
        "--rollout.max_num_batched_tokens 32 must hold a whole prompt and its answer (max_prompt_len + "
        "max_new_tokens = 64 tokens",
    ),
    Case(
        "vllm_cpu_kv_cache_of_a_fraction_of_a_gib",
        (*GRPO, "--rollout.engine", "vllm", "--rollout.cpu_kv_cache_gib", "0.5"),
        "--rollout.cpu_kv_cache_gib 0.5: vLLM on CPU takes its KV cache size in whole GiB (VLLM_CPU_KVCACHE_SPACE); "
        "use 1",
        needs_no_cuda=True,
    ),
    Case(
        "grpo_bnpo_split_by_pipeline_microbatches",
        (*GRPO, "--eval.interval", "0", "--parallelism.pipeline_parallel_degree", "2")
        + ("--grpo.loss_type", "bnpo", "--parallelism.pipeline_parallel_microbatch_size", "64"),
        "--grpo.loss_type bnpo averages each microbatch's token mean, and a pipeline microbatch (64 rows) splits it",
        world=2,
    ),
    Case(
        "grpo_sharded_reward_model_without_a_folder",
        (*GRPO, "--rl.reward_model_layout", "sharded"),
        "--rl.reward_model_layout sharded: --rl.rewards names no reward model folder to shard",
    ),
    Case(
        "grpo_reward_model_folder_without_config",
        (*GRPO, "--rl.rewards", "exact_match", "{empty}"),
        "--rl.rewards {empty}: no reward model there",
    ),
    Case(
        "grpo_reward_model_of_no_titanium_family",
        (*GRPO, "--rl.rewards", "exact_match", "{bert}"),
        "--rl.rewards {bert}: model_type 'bert' has no titanium family",
    ),
    Case(
        "grpo_reward_model_own_tokenizer_missing",
        (*GRPO, "--rl.rewards", "{llama3_classifier}", "--rl.reward_model_tokenizer", "own"),
        "--rl.rewards {llama3_classifier} with --rl.reward_model_tokenizer own: no tokenizer.json",
    ),
    Case(
        "grpo_reward_function_file_missing",
        (*GRPO, "--rl.rewards", "{empty}/nope.py:score"),
        "--rl.rewards '{empty}/nope.py:score': no file {empty}/nope.py",
    ),
    Case(
        "grpo_reward_function_missing_in_its_file",
        (*GRPO, "--rl.rewards", "{rewards_py}:absent"),
        "--rl.rewards '{rewards_py}:absent': {rewards_py} has no 'absent'",
    ),
    Case(
        "grpo_reward_function_of_the_wrong_signature",
        (*GRPO, "--rl.rewards", "{rewards_py}:one_argument"),
        "--rl.rewards '{rewards_py}:one_argument': one_argument(completion) cannot be called as a reward function",
    ),
    Case(
        "grpo_on_preference_data",
        (*GRPO, "--data.kind", "preference", "--data.path", DPO_DATA),
        "--training.objective grpo reads prompts: --data.kind chat, instruct or text, not preference",
    ),
    # ----- PPO
    Case(
        "ppo_vllm_batch_budget",
        (*PPO, "--rollout.engine", "vllm", "--rollout.max_num_batched_tokens", "40"),
        "--rollout.max_num_batched_tokens 40 must hold a whole prompt and its answer",
    ),
    Case(
        "ppo_value_model_of_another_family",
        (*PPO, "--ppo.value_model_path", "{qwen3_classifier}"),
        "--ppo.value_model_path: {qwen3_classifier}/config.json: model_type 'qwen3' is not a llama3 checkpoint "
        "('llama'); point --ppo.value_model_path at a llama3 checkpoint (this one is qwen3)",
    ),
    Case(
        "ppo_reward_model_of_another_family",
        (*PPO, "--rl.rewards", "{qwen3_classifier}", "--rl.reward_model_layout", "sharded"),
        "point --rl.rewards at a llama3 checkpoint (this one is qwen3)",
    ),
    Case(
        "ppo_value_model_not_a_classifier",
        (*PPO, "--ppo.value_model_path", "{llama3}", "--rl.rewards", "exact_match"),
        "--ppo.value_model_path {llama3}: {llama3}/config.json is not a one-label sequence classifier",
    ),
    Case(
        "ppo_unknown_rule_reward",
        (*PPO, "--rl.rewards", "no_such_reward"),
        "'no_such_reward' is not a known reward function",
    ),
    # ----- knowledge distillation
    Case(
        "kd_teacher_path_missing", (*KD, "--kd.teacher_path", "{empty}/nope"), "--kd.teacher_path {empty}/nope: no such"
    ),
    Case(
        "kd_unknown_teacher_model",
        (*KD, "--kd.teacher_path", "{empty}", "--kd.teacher_model", "gpt5"),
        "--kd.teacher_model 'gpt5' is not a known model; known models: gemma2, llama3",
    ),
    Case(
        "kd_unknown_teacher_flavor",
        (*KD, "--kd.teacher_path", "{empty}", "--kd.teacher_flavor", "7B"),
        "--kd.teacher_flavor '7B' is not a flavor of llama3; valid flavors: debugmodel",
    ),
    Case(
        "kd_titanium_teacher_without_a_flavor",
        (*KD, "--kd.teacher_path", "{empty}", "--kd.teacher_flavor", ""),
        "is a titanium checkpoint (no config.json): give its shape with --kd.teacher_flavor",
    ),
    Case(
        "kd_teacher_of_another_family",
        (*KD, "--kd.teacher_path", "{qwen3}"),
        "--kd.teacher_path: {qwen3}/config.json: model_type 'qwen3' is not a llama3 checkpoint ('llama'); use "
        "--kd.teacher_model qwen3",
    ),
    # ----- KTO, reward models, evaluation
    Case(
        "kto_on_preference_data",
        (*KTO, "--data.kind", "preference", "--data.path", DPO_DATA),
        "--training.objective kto needs completions labelled true/false: --data.kind unpaired, not preference",
    ),
    Case(
        "reward_objective_on_chat_data",
        (*REWARD, "--data.kind", "chat", "--data.path", "assets/tasks/arithmetic/train.jsonl"),
        "--training.objective reward needs preference pairs: --data.kind preference, not chat",
    ),
    Case(
        "reward_pairs_split_by_pipeline_microbatches",
        (*REWARD, "--validation.interval", "0", "--parallelism.pipeline_parallel_degree", "2")
        + ("--parallelism.pipeline_parallel_microbatch_size", "1"),
        "--parallelism.pipeline_parallel_microbatch_size 1: the reward objective keeps each pair's two rows together",
        world=2,
    ),
    Case(
        "reward_model_seq_len_too_short",
        (*REWARD, "--training.seq_len", "2"),
        "--training.seq_len 2: a reward model needs at least 3",
    ),
    Case(
        "evaluate_only_with_nothing_loaded",
        (*DEBUG, "--training.steps", "0", "--validation.interval", "1"),
        "--training.steps 0 evaluates the weights as loaded, and this run loads none",
    ),
    # ----- tools
    Case(
        "quantize_group_size_0",
        ("quantize", "{llama3_weights}", "{out}/q0", "--model", "llama3", "--scheme", "int4_weight_only")
        + ("--group-size", "0"),
        "--group-size must be >= 1 (inputs per weight scale; e.g. 32), got 0",
        module="titanium.tools.convert",
    ),
    Case(
        "quantize_filter_matches_nothing",
        ("quantize", "{llama3_weights}", "{out}/q1", "--model", "llama3", "--scheme", "int8_weight_only")
        + ("--filter-fqns", "lm_head"),
        "--filter-fqns: 'lm_head' matches no linear layer of the model",
        module="titanium.tools.convert",
    ),
    Case(
        "quantize_folder_of_another_family",
        ("quantize", "{llama3_weights}", "{out}/q2", "--model", "qwen3", "--scheme", "int8_weight_only"),
        "FOLDER: {llama3_weights}/config.json: model_type 'llama' is not a qwen3 checkpoint ('qwen3'); use --model "
        "llama3",
        module="titanium.tools.convert",
    ),
    Case(
        "convert_source_of_another_family",
        ("to-hf", "{llama3_dcp}/step-0", "{out}/hf0", "--model", "qwen3", "--source", "{llama3_weights}"),
        "--source: {llama3_weights}/config.json: model_type 'llama' is not a qwen3 checkpoint ('qwen3'); use --model "
        "llama3",
        module="titanium.tools.convert",
    ),
    Case(
        "convert_unknown_flavor",
        ("to-hf", "{llama3_dcp}/step-0", "{out}/hf1", "--model", "llama3", "--flavor", "7B"),
        "--flavor '7B' is not a flavor of llama3",
        module="titanium.tools.convert",
    ),
    Case(
        "generate_on_cuda_without_one",
        ("{llama3_weights}", "--prompt", "hi", "--device", "cuda"),
        "--device cuda: this machine has no CUDA GPU that torch can use; use --device cpu",
        module="titanium.tools.generate",
        needs_no_cuda=True,
    ),
    Case(
        "generate_folder_the_backend_cannot_lay_out",
        ("{gpt2}", "--prompt", "hi", "--tokenizer", DEBUG_TOKENIZER, "--chat-template", "none"),
        "model_type 'gpt2' is not supported by the transformers backend yet",
        module="titanium.tools.generate",
    ),
    Case(
        "generate_model_of_another_family",
        ("{llama3_weights}", "--prompt", "hi", "--model", "qwen3", "--tokenizer", DEBUG_TOKENIZER)
        + ("--chat-template", "none"),
        "FOLDER: {llama3_weights}/config.json: model_type 'llama' is not a qwen3 checkpoint ('qwen3'); use --model "
        "llama3",
        module="titanium.tools.generate",
    ),
    Case(
        "eval_preference_policy_neither_kind",
        ("{empty}", "{llama3_weights}", "--data", DPO_DATA, "--job.config_file", "train_configs/debug_dpo.toml")
        + ("--checkpoint.initial_load_path", ""),
        "POLICY {empty}: neither a titanium checkpoint (step-N with .metadata) nor a Hugging Face folder",
        module="titanium.tools.eval_preference",
    ),
    Case(
        "eval_preference_on_cuda_without_one",
        ("{llama3_weights}", "{llama3_weights}", "--data", DPO_DATA, "--device", "cuda"),
        "--device cuda: this machine has no CUDA GPU that torch can use",
        module="titanium.tools.eval_preference",
        needs_no_cuda=True,
    ),
]


def _config_folder(folder: Path, config: dict) -> str:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def make_folders(root: Path) -> dict[str, str]:
    """The folders the cases name: Hugging Face config.json folders (no weights: the checks read only the config),
    one tiny Llama with weights and its titanium checkpoint (for the tools), a reward-function file, an empty folder."""
    from titanium.tools.convert import main as convert

    folders = {"out": str(root / "out"), "empty": str(root / "empty")}
    (root / "empty").mkdir()
    for family in ("llama3", "qwen3", "qwen3_moe"):
        spec = get_model_spec(family)
        config = spec.hf_adapter.to_hf_config(spec.flavors["debugmodel_moe" if family == "qwen3_moe" else "debugmodel"])
        folders[family] = _config_folder(root / family, config)
        classifier = {
            **config,
            "architectures": [config["architectures"][0].replace("CausalLM", "SequenceClassification")],
        }
        folders[f"{family}_classifier"] = _config_folder(root / f"{family}_classifier", {**classifier, "num_labels": 1})
    for family, change, _ in FAMILY_FEATURES:
        spec = get_model_spec(family)
        config = spec.hf_adapter.to_hf_config(spec.flavors["debugmodel_moe" if family == "qwen3_moe" else "debugmodel"])
        folders[f"{family}_bad"] = _config_folder(root / f"{family}_bad", {**config, **change})
    moe = {**json.loads(Path(folders["qwen3_moe"], "config.json").read_text()), "mlp_only_layers": [0]}
    folders["qwen3_moe_dense_layer"] = _config_folder(root / "qwen3_moe_dense_layer", moe)
    folders["bert"] = _config_folder(root / "bert", {"model_type": "bert", "architectures": ["BertModel"]})
    vlm_config = json.loads(Path(REPO, VLM_FOLDER, "config.json").read_text())
    folders["vlm_no_processor"] = _config_folder(root / "vlm_no_processor", vlm_config)  # (config.json alone)
    folders["gpt2"] = _config_folder(root / "gpt2", {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    spec = get_model_spec("llama3")
    args = spec.flavors["debugmodel"]
    with torch.device("meta"):
        shapes = spec.model_cls(args).state_dict()
    weights = {k: torch.zeros(v.shape) for k, v in shapes.items()}
    folders["llama3_weights"] = str(save_hf_weights(weights, root / "llama3_weights", spec.hf_adapter, args))
    assert convert(["from-hf", folders["llama3_weights"], str(root / "llama3_dcp"), "--model", "llama3"]) == 0
    folders["llama3_dcp"] = str(root / "llama3_dcp")
    (root / "rewards.py").write_text("def one_argument(completion):\n    return 0.0\n")
    folders["rewards_py"] = str(root / "rewards.py")
    return folders


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    """Every case's exit code and stderr, from one launch of the case runner."""
    root = tmp_path_factory.mktemp("wave3")
    folders = make_folders(root)
    cases = [
        {
            "module": case.module,
            "argv": [arg.format(**folders) for arg in case.argv]
            + (["--job.dump_folder", str(root / "runs" / case.name)] if case.module == "titanium.preflight" else []),
            "env": {"WORLD_SIZE": str(case.world), **case.env},
        }
        for case in CASES
    ]
    (root / "cases.json").write_text(json.dumps(cases))
    command = [sys.executable, "-m", "tests.e2e.case_runner", str(root / "cases.json"), str(root / "results.json")]
    subprocess.run(command, cwd=REPO, env=env(), check=True, timeout=600, stdout=subprocess.DEVNULL)
    found = json.loads((root / "results.json").read_text())
    return {case.name: {**result, "folders": folders} for case, result in zip(CASES, found, strict=True)}


def test_the_table_covers_the_wave():
    assert len(CASES) >= 40 and len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_bad_input_is_one_message_and_exit_2(results, case: Case):
    if case.needs_no_cuda and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    result = results[case.name]
    err, message = result["stderr"], case.message.format(**result["folders"])
    lines = err.strip().splitlines()
    prefix = "titanium: " if case.module == "titanium.preflight" else f"{case.module}: error: "
    assert result["code"] == 2, err
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith(prefix), err
    assert message in lines[0], err


def test_a_moe_run_from_a_hf_folder_keeps_the_default_flavor(tmp_path):
    """The shape comes from config.json, so debug_model.toml's flavor (debugmodel, which Qwen3-MoE does not have) is
    not refused: the check is the folder's shape against the layout (the experts, here: 8 over EP 2)."""
    from titanium.config import load_config
    from titanium.preflight import check_job

    folder = make_folders(tmp_path)["qwen3_moe"]
    argv = [*DEBUG, "--model.name", "qwen3_moe", *hf_start(folder), "--parallelism.expert_parallel_degree", "2"]
    assert check_job(load_config(argv), 2).ep == 2
