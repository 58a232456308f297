"""The dry run builds a large layout's plan on a fake process group and reports its shards (MoE included)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.helpers import REPO
from tests.objectives.tiny_hf import debug_model_hf
from titanium.models import build_model_args, get_model_spec
from titanium.models.reward import reward_spec
from titanium.tools.dry_run import dry_run, main
from titanium.tools.memory_estimate import BESIDE


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_405b_on_512_ranks_fsdp64_tp8(in_repo):
    run = dry_run(["--job.config_file", "train_configs/llama3_405b.toml"], world_size=512)
    d = run.dims
    assert (d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp) == (1, 1, 64, 1, 8)
    params = {p.name: p for p in run.params}
    wq, wo = params["layers.0.attention.wq.weight"], params["layers.125.attention.wo.weight"]
    assert wq.global_shape == (16384, 16384) and wq.local_shape == (32, 16384)  # rows / 8 (tp) / 64 (fsdp)
    assert wo.local_shape == (256, 2048)  # columns / 8 (tp), rows / 64 (fsdp)
    assert wq.mesh_dims == ("dp_shard", "tp") and wq.placements.endswith("Shard(dim=0))")
    assert wo.placements == "(Shard(dim=0), Shard(dim=1))"
    assert params["norm.weight"].placements == "(Shard(dim=0), Replicate())"
    assert params["output.weight"].local_shape == (251, 16384)  # 128256 / 8 / 64 = 250.5: uneven, rank 0 has 251
    total = sum(p.numel() for p in run.model.parameters())
    assert run.local_numel == pytest.approx(total / 512, rel=0.01)


def test_cli_prints_the_plan_and_rejects_bad_layouts(in_repo, capsys):
    args = ["--job.config_file", "train_configs/llama3_8b.toml", "--parallelism.tensor_parallel_degree", "2"]
    assert main([*args, "--world_size", "16", "--no_memory"]) == 0
    out = capsys.readouterr().out
    assert "world 16 = pp 1 x dp_replicate 1 x dp_shard 8 x cp 1 x tp 2" in out
    assert "layers.0.attention.wk.weight" in out and "layers.1." not in out
    assert main([*args[:2], "--parallelism.tensor_parallel_degree", "16", "--world_size", "16", "--no_memory"]) == 2
    assert "must divide n_kv_heads=8" in capsys.readouterr().err


def test_405b_on_512_ranks_pp16_fsdp4_tp8(in_repo):
    """The layout of the issue: pp 16 x dp 4 x tp 8; the last rank holds the last stage."""
    args = ["--job.config_file", "train_configs/llama3_405b.toml", "--parallelism.pipeline_parallel_degree", "16"]
    args += ["--training.local_batch_size", "16"]  # (1F1B needs at least one microbatch per stage)
    run = dry_run(args, world_size=512, rank=511)
    d = run.dims
    assert (d.pp, d.dp_shard, d.tp) == (16, 4, 8)
    assert run.stages == ([15], 16)
    params = {p.name: p for p in run.params}
    blocks = sorted({int(n.split(".")[1]) for n in params if n.startswith("layers.")})
    assert blocks == list(range(119, 126))  # 126 blocks: 14 stages of 8, then 2 of 7
    assert "tok_embeddings.weight" not in params and params["output.weight"].local_shape == (4008, 16384)
    assert params["layers.125.attention.wq.weight"].local_shape == (512, 16384)  # 16384 / 8 / 4


# MoE: expert parallelism is planned, and memory is estimated without tracing data-dependent routing; the shipped
# Qwen3-MoE configs fit an 80 GB GPU at 8, 64 and 256 ranks, each estimate in under a minute.


def test_30b_a3b_on_64_ranks_divides_the_experts(in_repo):
    run = dry_run(["--job.config_file", "train_configs/qwen3_30b_a3b.toml"], world_size=64, rank=9)
    assert (run.dims.dp_shard, run.dims.ep) == (64, 8)
    params = {p.name: p for p in run.params}
    w1 = params["layers.47.moe.experts.w1"]
    assert w1.global_shape == (128, 768, 2048) and w1.mesh_dims == ("efsdp", "ep")
    assert w1.local_shape == (2, 768, 2048)  # 128 experts / 8 (ep) / 8 (FSDP over efsdp)
    assert params["layers.0.moe.router.gate.weight"].mesh_dims == ("dp_shard",)
    total = sum(p.numel() for p in run.model.parameters())
    assert run.local_numel == pytest.approx(total / 64, rel=0.01)


@pytest.mark.parametrize("config, world", [("qwen3_30b_a3b", 8), ("qwen3_30b_a3b", 64), ("qwen3_235b_a22b", 256)])
def test_the_shipped_moe_plans_fit_an_h100(in_repo, capsys, config, world):
    start = time.perf_counter()
    assert main(["--job.config_file", f"train_configs/{config}.toml", "--world_size", str(world)]) == 0
    assert time.perf_counter() - start < 60, config
    out = capsys.readouterr().out
    assert "% of 78 GiB: fits" in out and "receives 1.25x its even share" in out, out[-2000:]


def test_a_second_dry_run_in_the_process_uses_its_own_process_groups(in_repo):
    """Two dry runs of 8 ranks, pp 2 then none: their TP meshes of rank 0 are equal (ranks 0-1, "tp") but have other
    process groups. DTensor caches each op's output spec, mesh included, by its input specs, and meshes compare by
    ranks and names: the second run's parameters landed on the first run's destroyed groups, and its memory
    estimate failed with "Could not resolve the process group registered under the name 25"."""
    args = ["--job.config_file", "train_configs/debug_model.toml", "--parallelism.tensor_parallel_degree", "2"]
    assert main([*args, "--world_size", "8", "--parallelism.pipeline_parallel_degree", "2", "--no_memory"]) == 0
    run = dry_run(args, world_size=8)
    meshes = [p.device_mesh for p in run.model.parameters() if isinstance(p, DTensor)]  # (a set: stale == new)
    assert meshes and all(mesh.get_group(dim) for mesh in meshes for dim in range(mesh.ndim))


def test_the_estimate_counts_the_objectives_other_models(in_repo, tmp_path):
    """The frozen models the objective builds, on this rank under the same plan (FSDP over 2: half of each): a kd
    teacher (here of the student's shape), a DPO, KTO or PPO reference copy, PPO's reward model and GRPO's sharded
    one (a whole one is the objective's own), and no copy for a
    LoRA policy's reference; and PPO's value model, which trains: its parameters and two AdamW moments (three times
    its half), and, as its backward turns them into its gradients (a fourth), the activations its forward keeps (the
    policy's body's, by the estimator's own trace), whichever is larger; and the rollout engine's whole copy of the
    policy. The peak grows by exactly these (the policy's trace is the same)."""
    common = [
        "--job.config_file", "train_configs/debug_sft.toml", "--checkpoint.initial_load_path", "",
        "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32",
    ]  # fmt: skip

    beside = {}

    def estimate(*extra: str, trained: int = 0) -> tuple[float, int]:
        run = dry_run([*common, *extra], world_size=2, device_type="cpu")
        try:
            assert run.trained_bytes == pytest.approx(trained, rel=1e-3), (extra, run.trained_bytes)
            result = run.estimate_memory()
            beside[extra] = dict(result.parts).get(BESIDE, 0.0), result.body_activations, run.job.accumulation
            return result.peak, run.frozen_bytes
        finally:
            dist.destroy_process_group()

    kd = ("--training.objective", "kd", "--kd.teacher_path", str(tmp_path), "--kd.teacher_flavor", "debugmodel")
    dpo = ("--training.objective", "dpo", "--data.kind", "preference")
    sft_peak, sft_frozen = estimate()
    kd_peak, teacher = estimate(*kd)
    dpo_peak, reference = estimate(*dpo)
    _, lora_reference = estimate(*dpo, "--lora.rank", "4")
    _, kto_reference = estimate("--training.objective", "kto", "--data.kind", "unpaired")
    spec = get_model_spec("llama3")
    with torch.device("meta"):
        student = spec.model_cls(build_model_args(spec, "debugmodel", max_seq_len=64))
        # PPO's reward and value models: the body with a one-output head in place of the vocabulary's
        scalar = reward_spec(spec, pad_token_id=None)
        scorer = scalar.model_cls(build_model_args(scalar, "debugmodel", max_seq_len=64))
    half_fp32 = sum(p.numel() for p in student.parameters()) * 4 // 2
    half_scorer_fp32 = sum(p.numel() for p in scorer.parameters()) * 4 // 2
    ppo = ("--training.objective", "ppo", "--data.kind", "chat", "--rl.rewards", "exact_match")
    ppo += ("--rl.max_prompt_len", "48", "--rl.max_new_tokens", "16")
    value = 4 * half_scorer_fp32  # (the value model trains: its parameters, gradients and 2 AdamW moments)
    ppo_peak, ppo_reference = estimate(*ppo, trained=value)
    rm = debug_model_hf(tmp_path / "rm", True)
    _, ppo_reference_and_scorer = estimate(*ppo, "--ppo.reward_model_path", rm, trained=value)
    assert sft_frozen == 0 and lora_reference == 0
    # (uneven shards: a few rows more)
    assert teacher == reference == kto_reference == ppo_reference == pytest.approx(half_fp32, rel=1e-3)
    assert ppo_reference_and_scorer - ppo_reference == pytest.approx(half_scorer_fp32, rel=1e-3)
    grpo = ("--training.objective", "grpo", "--data.kind", "chat", "--grpo.group_size", "2", "--rl.rewards", rm)
    grpo += ("--rl.max_prompt_len", "48", "--rl.max_new_tokens", "16")
    _, grpo_reference = estimate(*grpo)  # (a whole reward model is the objective's own, beside the plan)
    _, grpo_reference_and_sharded = estimate(*grpo, "--rl.reward_model_layout", "sharded")
    assert grpo_reference_and_sharded - grpo_reference == pytest.approx(half_scorer_fp32, rel=1e-3)
    engine = 2 * half_fp32  # (unsharded, in the training dtype)
    # the value model's forward activations: the policy's trace's, without the output projection and the loss (here
    # larger than its gradients: one microbatch per step)
    value_activations, body, accumulation = beside[ppo]
    assert value_activations == body > value / 4 and accumulation == 1 and beside[()][0] == 0  # (sft: none)
    grown = ppo_reference + value * 3 / 4 + body + engine
    assert ppo_peak == pytest.approx(sft_peak + grown, rel=0.01)
    # (the same student's traces agree to within a one-time allocation of the first trace in a process, ~0.3%)
    assert kd_peak == pytest.approx(sft_peak + teacher, rel=0.01) and kd_peak > sft_peak
    assert dpo_peak > sft_peak


def test_the_value_models_activations_and_gradients_are_added_where_they_are_alive():
    """Its backward runs first and turns its activations into its gradients: until the backward leaves the blocks the
    larger of the two (both when the step accumulates, the gradients of the earlier microbatches being alive),
    afterwards its gradients."""
    from titanium.tools.memory_estimate import BESIDE_GRADIENTS, REGIONS, Trace, _add_beside

    for accumulation, blocks_high in ((1, 100 + 30), (2, 100 + 30 + 20)):
        trace = Trace(peaks={REGIONS[0]: 100.0, REGIONS[1]: 90.0}, parts={r: {} for r in REGIONS}, saved=[], body=[])
        _add_beside(trace, activations=30.0, gradients=20.0, accumulation=accumulation)
        assert trace.peaks == {REGIONS[0]: blocks_high, REGIONS[1]: 90 + 20}
        assert sum(trace.parts[REGIONS[0]].values()) == blocks_high - 100
        assert trace.parts[REGIONS[1]] == {BESIDE_GRADIENTS: 20}


def test_a_split_rollout_engine_is_counted_by_this_ranks_part(in_repo):
    """With --rollout.tensor_parallel_size 2 (the tensor-parallel degree) each rank holds half of every projection
    of the titanium engine's copy (generation/tp_plan.py): the estimate counts that part, not the whole copy."""
    grpo = ["--job.config_file", "train_configs/debug_grpo.toml", "--checkpoint.initial_load_path", ""]
    grpo += ["--parallelism.tensor_parallel_degree", "2", "--eval.interval", "0"]

    def engine(*extra: str) -> int:
        run = dry_run([*grpo, *extra], world_size=2, device_type="cpu")
        try:
            return run.engine_bytes
        finally:
            dist.destroy_process_group()

    whole, split = engine(), engine("--rollout.tensor_parallel_size", "2")
    spec = get_model_spec("llama3")
    with torch.device("meta"):
        model = spec.model_cls(build_model_args(spec, "debugmodel", max_seq_len=64))
    numel = sum(p.numel() for p in model.parameters())
    projections = sum(p.numel() for n, p in model.named_parameters() if n.split(".")[-2] in PROJECTIONS)
    assert whole % numel == 0 and whole - split == projections // 2 * (whole // numel)


PROJECTIONS = {"wq", "wk", "wv", "wo", "w1", "w2", "w3", "output"}
