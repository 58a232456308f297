"""Which code builds a model from a Hugging Face folder (``--model.name auto``: the native family that reads its
model_type, else the transformers backend; ``[model] backend``), and the backend's bad input: one message, exit
code 2, before any process group (the preflight checks ``titanium.train`` and ``run_train.sh`` run first)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.backend_matrix.configs import tiny_config as matrix_config
from tests.objectives.tiny_backend import SHAPE, tiny_config
from titanium.config.errors import ConfigError
from titanium.config.sections import ModelSection
from titanium.model_builder import resolve_spec
from titanium.preflight import main as preflight

transformers = pytest.importorskip("transformers")

JOB = ["--job.config_file", "train_configs/debug_model.toml"]


def config_folder(root: Path, name: str, config: dict) -> str:
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_the_family_or_backend_follows_from_config_json(tmp_path: Path) -> None:
    llama = config_folder(tmp_path, "llama", tiny_config("llama").to_dict())
    gemma = config_folder(tmp_path, "gemma", tiny_config("gemma3_text").to_dict())
    spec, why = resolve_spec(ModelSection(), llama)
    assert spec.name == "llama3" and "native family that reads model_type 'llama'" in why
    spec, why = resolve_spec(ModelSection(), gemma)
    assert spec.name == "transformers" and "no native family reads model_type 'gemma3_text'" in why
    assert "Gemma3ForCausalLM" in why
    assert resolve_spec(ModelSection(backend="transformers"), llama)[0].name == "transformers"
    assert resolve_spec(ModelSection(name="qwen3"), llama)[0].name == "qwen3"  # (hf_model_args then refuses it)
    assert resolve_spec(ModelSection(), None)[0].name == "llama3"  # (no config.json: the default family)
    with pytest.raises(ConfigError, match="--model.backend native: no titanium family reads model_type 'gemma3_text'"):
        resolve_spec(ModelSection(backend="native"), gemma)
    with pytest.raises(ConfigError, match="leave --model.name out"):
        resolve_spec(ModelSection(name="llama3", backend="transformers"), llama)


def _refused(capsys, world_size: int, monkeypatch, *args: str) -> str:
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    assert preflight([*JOB, *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("titanium:") == 1, err
    return err


def test_bad_input_is_one_message_before_any_process_group(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    small = {k: v for k, v in SHAPE.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
    unknown = config_folder(tmp_path, "unknown", {"model_type": "nonexistent_lm", **small})
    remote = config_folder(tmp_path, "remote", {"model_type": "custom_lm", "auto_map": {"AutoConfig": "c.C"}, **small})
    stablelm = config_folder(tmp_path, "stablelm", transformers.StableLmConfig(**small).to_dict())
    olmoe = config_folder(tmp_path, "olmoe", transformers.OlmoeConfig(**small).to_dict())
    gpt2 = config_folder(tmp_path, "gpt2", transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4).to_dict())
    err = _refused(capsys, 1, monkeypatch, "--model.hf_config", unknown)
    assert "model_type 'nonexistent_lm' is not known to the installed transformers" in err
    err = _refused(capsys, 1, monkeypatch, "--model.hf_config", remote)
    assert "names modeling code of its own (auto_map): to run that code, set --model.trust_remote_code" in err
    err = _refused(capsys, 2, monkeypatch, "--model.hf_config", stablelm, "--parallelism.tensor_parallel_degree", "2")
    assert "--parallelism.tensor_parallel_degree 2: stablelm has no tensor-parallel plan (base_model_tp_plan)" in err
    pp = ("--parallelism.pipeline_parallel_degree", "2", "--moe.load_balance", "bias")
    err = _refused(capsys, 2, monkeypatch, "--model.hf_config", olmoe, *pp)
    assert "--parallelism.pipeline_parallel_degree 2: olmoe has no pipeline plan (base_model_pp_plan)" in err
    err = _refused(capsys, 1, monkeypatch, "--model.hf_config", gpt2)
    assert "GPT2LMHeadModel is not laid out as the backend needs" in err
    err = _refused(capsys, 1, monkeypatch, "--model.backend", "transformers")
    assert "the transformers backend builds a model from a Hugging Face config.json" in err
    err = _refused(capsys, 1, monkeypatch, "--model.hf_config", stablelm, "--model.backend", "native")
    assert "--model.backend native: no titanium family reads model_type 'stablelm'" in err


def test_what_a_model_with_its_own_attention_cannot_do(tmp_path: Path, capsys, monkeypatch) -> None:
    """GPT-OSS (sinks) decodes with transformers' cache, which a compiled decode step cannot take, and its TP plan
    splits no layer, nor does context parallelism split its rows, and vLLM's build of it samples other log-probs;
    Qwen3.5's linear-attention layers would mix packed samples; Sarvam MoE's checkpoints hold a fused query_key_value
    the backend does not convert (Mixtral's and Qwen2-MoE's per-expert tensors it does: tests/unit/test_backend_moe.py);
    titanium's split decoding copy is the native families'."""
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    gpt_oss = config_folder(tmp_path, "gpt_oss", tiny_config("gpt_oss").to_dict())
    qwen = config_folder(tmp_path, "qwen3_5", tiny_config("qwen3_5_text").to_dict())
    gemma = config_folder(tmp_path, "gemma", tiny_config("gemma3_text").to_dict())
    grpo = ("--training.objective", "grpo", "--data.kind", "chat", "--rl.rewards", "exact_match")
    grpo += ("--rl.max_prompt_len", "48", "--rl.max_new_tokens", "8")
    err = _refused(capsys, 1, monkeypatch, "--model.hf_config", gpt_oss, *grpo, "--rollout.compile")
    assert "--rollout.compile: gpt_oss runs its own attention (its attention has sinks)" in err
    assert "leave --rollout.compile off" in err
    err = _refused(capsys, 2, monkeypatch, "--model.hf_config", gpt_oss, "--parallelism.tensor_parallel_degree", "2")
    assert "its plan splits no layer (embed_tokens only)" in err
    sft = ("--training.objective", "sft", "--data.kind", "chat")
    err = _refused(capsys, 1, monkeypatch, "--model.hf_config", qwen, *sft)
    assert "--sft.packing: qwen3_5_text runs its own attention (it has linear_attention layers" in err
    assert "set --sft.no_packing" in err
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert preflight([*JOB, "--model.hf_config", qwen, *sft, "--sft.no_packing"]) == 0
    err = _refused(capsys, 1, monkeypatch, "--model.hf_config", gpt_oss, *sft)
    assert "--moe.load_balance aux_loss: gpt_oss's MoE blocks run as transformers wrote them" in err
    monkeypatch.setenv("WORLD_SIZE", "1")
    unbalanced = ("--moe.load_balance", "none")
    assert preflight([*JOB, "--model.hf_config", gpt_oss, *sft, *unbalanced]) == 0  # (packed: its own attention)
    for model_type in ("sarvam_moe", "mixtral", "qwen2_moe"):
        folder = config_folder(tmp_path, model_type, matrix_config(model_type).to_dict())
        start = ("--checkpoint.initial_load_path", folder, "--checkpoint.initial_load_in_hf")
        start += ("--moe.load_balance", "none")
        if model_type == "sarvam_moe":  # (its attention's query_key_value, which transformers splits on loading)
            err = _refused(capsys, 1, monkeypatch, *start)
            assert "its Hugging Face checkpoints hold tensors that transformers converts on loading" in err
            assert "query_key_value" in err
        else:  # (per-expert tensors, read and written for titanium's MoE and for MoE blocks of transformers' own)
            monkeypatch.setenv("WORLD_SIZE", "1")
            assert preflight([*JOB, *start]) == 0
    err = _refused(capsys, 2, monkeypatch, "--model.hf_config", gpt_oss, "--parallelism.context_parallel_degree", "2")
    assert "--parallelism.context_parallel_degree 2: gpt_oss runs its own attention (its attention has sinks)" in err
    err = _refused(capsys, 1, monkeypatch, "--model.hf_config", gpt_oss, *grpo, "--rollout.engine", "vllm")
    assert "--rollout.engine vllm: vLLM's GPT-OSS computes other log-probs than titanium's" in err
    deepseek = config_folder(tmp_path, "deepseek", tiny_config("deepseek_v3").to_dict())
    err = _refused(capsys, 1, monkeypatch, "--model.hf_config", deepseek)  # (no router_aux_loss_coef)
    assert "--moe.aux_loss_coef: this model has no default" in err and "--moe.load_balance bias" in err
    monkeypatch.setenv("WORLD_SIZE", "1")
    bias = ("--moe.load_balance", "bias")
    assert preflight([*JOB, "--model.hf_config", deepseek, *bias]) == 0  # (from its config.json alone: it trains)
    reward = ("--training.objective", "reward", "--data.kind", "preference")
    granite = config_folder(tmp_path, "granite", tiny_config("granite").to_dict())
    err = _refused(capsys, 1, monkeypatch, "--model.hf_config", granite, *reward)
    assert "transformers has no *ForSequenceClassification for granite" in err
    assert preflight([*JOB, "--model.hf_config", gemma, *reward]) == 0
    split = ("--parallelism.tensor_parallel_degree", "2", "--rollout.tensor_parallel_size", "2")
    err = _refused(capsys, 2, monkeypatch, "--model.hf_config", gemma, *grpo, *split)
    assert "--rollout.tensor_parallel_size 2: titanium's engine splits the native families' layers only" in err


REMOTE_CONFIG = """
from transformers import LlamaConfig


class TinyCustomConfig(LlamaConfig):
    model_type = "tiny_custom"
"""
REMOTE_MODEL = """
from transformers import LlamaForCausalLM

from .configuration_tiny import TinyCustomConfig


class TinyCustomForCausalLM(LlamaForCausalLM):
    config_class = TinyCustomConfig
"""


def test_trust_remote_code_runs_the_folders_own_code_only_when_allowed(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    config = {
        **tiny_config("llama").to_dict(),
        "model_type": "tiny_custom",
        "architectures": ["TinyCustomForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_tiny.TinyCustomConfig",
            "AutoModelForCausalLM": "modeling_tiny.TinyCustomForCausalLM",
        },
    }
    folder = config_folder(tmp_path, "custom", config)
    (Path(folder) / "configuration_tiny.py").write_text(REMOTE_CONFIG)
    (Path(folder) / "modeling_tiny.py").write_text(REMOTE_MODEL)
    _refused(capsys, 1, monkeypatch, "--model.hf_config", folder)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert preflight([*JOB, "--model.hf_config", folder, "--model.trust_remote_code"]) == 0
    spec, _ = resolve_spec(ModelSection(hf_config=folder, trust_remote_code=True), folder)
    args = spec.hf_adapter.from_hf_config(config)
    model = spec.model_cls(args)
    assert type(model._hf).__name__ == "TinyCustomForCausalLM" and model.attention == "titanium"


def test_the_dry_run_plans_backend_models(tmp_path: Path, capsys, monkeypatch) -> None:
    """A Gemma 3 from its config.json alone, planned for 4 ranks (dp_shard 2 x tp 2) and estimated: its q/k norms
    replicated, its projections split as its plan says, the embedding and head by vocabulary."""
    from titanium.tools.dry_run import main as dry_run

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    gemma = config_folder(tmp_path, "gemma", tiny_config("gemma3_text").to_dict())
    tp = ("--parallelism.tensor_parallel_degree", "2")
    assert dry_run([*JOB, "--model.hf_config", gemma, "--world_size", "4", *tp]) == 0
    out = capsys.readouterr().out
    assert f"model transformers from {gemma}" in out and "fits" in out
    assert "layers.0.self_attn.q_proj.weight" in out and "layers.0.self_attn.q_norm.weight" in out
