"""MoE and expert-parallel mistakes end the run with one message and exit code 2: the layout and [moe] checks
before any process group exists (the world size comes from WORLD_SIZE, as under torchrun), a Hugging Face
config.json with features Qwen3-MoE does not have when the run starts from it."""

from __future__ import annotations

import json

import pytest
import torch.distributed

from tests.helpers import tiny_args
from titanium.models import get_model_spec
from titanium.train import main

MOE = ("--model.name", "qwen3_moe", "--model.flavor", "debugmodel_moe")
GRPO = (
    "--training.objective", "grpo", "--grpo.group_size", "4", "--rl.max_prompt_len", "40",
    "--rl.max_new_tokens", "8",
)  # fmt: skip

LAYOUT_MISTAKES = [
    (
        6,
        ("--parallelism.expert_parallel_degree", "4"),
        "--parallelism.expert_parallel_degree 4 must divide data_parallel_shard_degree x context_parallel_degree "
        "= 6 x 1 = 6 (expert parallelism borrows those ranks); valid degrees: 1, 2, 3, 6",
    ),
    (
        6,
        ("--parallelism.expert_parallel_degree", "3"),
        "--parallelism.expert_parallel_degree 3 must divide the 8 experts of qwen3_moe debugmodel_moe; valid "
        "degrees with this layout: 1, 2",
    ),
    (
        2,
        ("--parallelism.expert_parallel_degree", "2", "--model.name", "qwen3", "--model.flavor", "debugmodel"),
        "--parallelism.expert_parallel_degree 2: qwen3 debugmodel is a dense model, it has no experts to divide; use 1",
    ),
    (
        2,
        ("--parallelism.pipeline_parallel_degree", "2"),
        "--moe.load_balance aux_loss sums router statistics over all layers before the backward, which pipeline "
        "stages cannot; use --moe.load_balance bias (or none) with --parallelism.pipeline_parallel_degree > 1",
    ),
    (
        1,
        ("--moe.load_balance", "bias", "--checkpoint.last_save_in_hf"),
        "--moe.load_balance bias trains a routing bias that the Hugging Face qwen3_moe format has no slot for, so "
        "--checkpoint.last_save_in_hf could not export the model; use --moe.load_balance aux_loss, or unset "
        "--checkpoint.last_save_in_hf",
    ),
    (
        1,
        ("--moe.load_balance", "bias", *GRPO, "--rollout.engine", "vllm"),
        "--moe.load_balance bias trains a routing bias that the Hugging Face qwen3_moe format has no slot for, so "
        "--rollout.engine vllm (loaded through that format) could not take the trained weights; use "
        "--moe.load_balance aux_loss, or --rollout.engine titanium",
    ),
]


@pytest.mark.parametrize("world, args, message", LAYOUT_MISTAKES)
def test_moe_layout_mistakes_exit_2_before_any_process_group(tmp_path, capsys, monkeypatch, world, args, message):
    def refuse(*args, **kwargs):
        raise AssertionError("a process group was created before the config was checked")

    monkeypatch.setattr(torch.distributed, "init_process_group", refuse)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert main(tiny_args(tmp_path, *MOE, *args)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"titanium: config error: {message}") and err.count("\n") == 1, err


HF_MISTAKES = [
    ({"num_experts_per_tok": 10}, "num_experts_per_tok 10 is larger than num_experts 8: a token cannot pick more"),
    ({"shared_expert_intermediate_size": 512}, "shared_expert_intermediate_size = 512 (shared experts (Qwen2-MoE))"),
    ({"scoring_func": "sigmoid"}, "scoring_func = 'sigmoid' (a non-softmax router) is not part of Qwen3-MoE"),
    ({"mlp_only_layers": [7]}, "mlp_only_layers [7] are not layers 0..3"),
]


@pytest.mark.parametrize("change, message", HF_MISTAKES)
def test_hf_config_with_foreign_moe_features_exits_2(tmp_path, capsys, change, message):
    """Only config.json is read before the check (no tensors): the folder needs nothing else."""
    spec = get_model_spec("qwen3_moe")
    folder = tmp_path / "hf"
    folder.mkdir()
    config = {**spec.hf_adapter.to_hf_config(spec.flavors["debugmodel_moe"]), **change}
    (folder / "config.json").write_text(json.dumps(config))
    args = ("--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf")
    assert main(tiny_args(tmp_path / "run", *MOE, *args)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("titanium: error: ") == 1 and "Traceback" not in err, err
