"""Every rank reads only its part of a Hugging Face checkpoint, and the loaded weights are exactly one process's.

One 4-process launch (``hf_stream_worker``) loads a Qwen3-MoE checkpoint (RoPE rows, stacked experts) and a
Phi-3 one (fused ``qkv_proj``/``gate_up_proj``), both bf16 in several files, into layouts that shard each weight
1, 2 and 4 ways (HSDP replicate 4, HSDP 2x2, FSDP 4), and into TP 2 x FSDP 2, EP 2 x FSDP 2 (strided expert
shards) and EP 4; and a Qwen2-MoE one saved by ``transformers`` (the transformers backend, whose MoE blocks run as
transformers wrote them: each expert's ``gate_proj`` and ``up_proj`` are read into the rows of its stacked
``gate_up_proj``) into the first three (TP and EP are refused for those blocks). Every gathered weight must equal
the whole-checkpoint load bit for bit. The bytes each rank reads must fall with the shard count: at most 1/2 and
1/4 of the checkpoint at 2 and 4 shards, with 2% for the whole heads that the RoPE permutation reads (measured:
exactly 1/2 and 1/4). ``benchmarks/hf_load_memory.py`` measures peak host memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers import run_train
from titanium.checkpoint.hf import save_hf_weights
from titanium.model_builder import ModelBuilder
from titanium.models import build_model_args, get_model_spec


def make_checkpoint(folder: Path, model: str, flavor: str) -> None:
    spec = get_model_spec(model)
    args = build_model_args(spec, flavor)
    model_ = ModelBuilder(torch.device("cpu"), seed=3).build(spec, args).model
    save_hf_weights(model_.state_dict(), folder, spec.hf_adapter, args, dtype=torch.bfloat16, max_shard_bytes=4 * 10**6)


def make_backend_checkpoint(folder: Path, model_type: str) -> None:
    """A tiny random ``model_type`` saved by ``transformers`` in bf16, in several files."""
    from transformers import AutoModelForCausalLM

    from tests.backend_matrix.configs import tiny_config
    from tests.parity.harness import randomize_

    model = AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float32)
    randomize_(model, 3)
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="300KB")


def test_each_rank_reads_its_part_and_loads_exactly(tmp_path: Path) -> None:
    folders = {"qwen3_moe": tmp_path / "qwen3_moe", "phi3": tmp_path / "phi3", "qwen2_moe": tmp_path / "qwen2_moe"}
    make_checkpoint(folders["qwen3_moe"], "qwen3_moe", "debugmodel_moe")
    make_checkpoint(folders["phi3"], "phi3", "debugmodel")
    make_backend_checkpoint(folders["qwen2_moe"], "qwen2_moe")
    assert all(len(list(folders[name].glob("*.safetensors"))) > 1 for name in ("qwen3_moe", "qwen2_moe"))
    out = tmp_path / "out"
    out.mkdir()
    run_train([str(out), *map(str, folders.values())], nproc=4, module="tests.distributed.hf_stream_worker")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    for name in folders:
        layouts = {layout: [rank[name][layout] for rank in ranks] for layout in ranks[0][name]}
        expected = {"one_process", "replicate4", "hsdp2x2", "fsdp4"} | ({"tp2_fsdp2"} if name != "qwen2_moe" else set())
        assert set(layouts) >= expected | ({"ep2_fsdp2", "ep4"} if name == "qwen3_moe" else set())
        for layout, per_rank in layouts.items():
            assert all(not result["differ"] for result in per_rank), (name, layout, per_rank)
        total = layouts["one_process"][0]["bytes"]
        most = {layout: max(result["bytes"] for result in per_rank) for layout, per_rank in layouts.items()}
        assert most["replicate4"] == total, (name, most)
        for layout, shards in (("hsdp2x2", 2), ("fsdp4", 4)):  # (measured: exactly 1/2 and 1/4)
            assert most[layout] <= 1.02 * total / shards, (name, layout, most)
