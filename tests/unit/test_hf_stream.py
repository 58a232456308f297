"""Reading a shard of a Hugging Face checkpoint gives exactly that shard of the whole-checkpoint conversion; writing
one block at a time gives exactly the folder that the whole state dict gives.

For every family with an adapter (renames, tied embeddings, RoPE row permutation, Phi-3's fused tensors, stacked
experts), random weights are written as HF safetensors; then every tensor is read for a made-up shard: random
rows and columns in a random order, as strided shards can hold them, some dimensions whole, some empty. Each
must equal the same positions picked from ``from_hf`` of the whole checkpoint, bit for bit. The layouts that
produce such shards in practice run in ``tests/distributed/test_hf_streaming.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import titanium.checkpoint.hf_stream as hf_stream
from titanium.checkpoint.hf_stream import SliceReader, stream_into
from titanium.models import build_model_args, get_model_spec, list_models
from titanium.models.hf_adapter import HFAdapter
from titanium.models.reward_hf import sequence_classification_adapter


def made_up_shard(shape: torch.Size, generator: torch.Generator) -> list[torch.Tensor | None]:
    index: list[torch.Tensor | None] = []
    for size in shape:
        kind = torch.randint(0, 4, (), generator=generator).item()
        if kind == 0:
            index.append(None)
        elif kind == 1 and size > 1:  # a contiguous run
            start = torch.randint(0, size - 1, (), generator=generator).item()
            index.append(torch.arange(start, size))
        else:  # scattered positions in any order (possibly none)
            count = torch.randint(0, size + 1, (), generator=generator).item()
            index.append(torch.randperm(size, generator=generator)[:count])
    return index


FAMILIES = [name for name in list_models() if get_model_spec(name).flavors]
"""The native families (the transformers backend, registered once imported, has no flavors: its own tests)."""


@pytest.mark.parametrize("model", [*FAMILIES, "phi3_reward"])
def test_shards_read_equal_the_whole_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str) -> None:
    """(``phi3_reward``: the sequence-classification adapter around Phi-3's, with its fused tensors.)"""
    spec = get_model_spec(model.removesuffix("_reward"))
    args = build_model_args(spec, next(iter(spec.flavors)), vocab_size=64)
    if model == "qwen3":  # the other tied families are covered by their flavors; check untied Qwen3 too
        args = type(args)(**{**vars(args), "tie_word_embeddings": False})
    adapter = spec.hf_adapter
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in spec.model_cls(args).state_dict().items() if adapter.has_hf_slot(k)}
    if model.endswith("_reward"):
        adapter = sequence_classification_adapter(adapter, pad_token_id=0)
        shapes[adapter.output_key] = torch.Size([1, args.dim])
    shards_read_equal_the_whole_conversion(tmp_path, monkeypatch, adapter, args, shapes)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "mixtral"])
def test_backend_experts_read_by_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_type: str) -> None:
    """The transformers backend's per-expert checkpoints: Qwen2-MoE's blocks run as transformers wrote them, whose
    ``gate_up_proj`` rows are each expert's ``gate_proj`` then ``up_proj`` (a shard's rows may lie in either or
    both); Mixtral's are titanium's MoE, read from ``block_sparse_moe.experts.E.w1``."""
    from tests.backend_matrix.configs import tiny_config_dict
    from titanium.models.transformers import TransformersModel
    from titanium.models.transformers.hf import TRANSFORMERS_HF_ADAPTER

    config = tiny_config_dict(model_type)
    adapter = TRANSFORMERS_HF_ADAPTER.for_config(config)
    args = adapter.from_hf_config(config, max_seq_len=64)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in TransformersModel(args).state_dict().items() if adapter.has_hf_slot(k)}
    fused = "layers.0.mlp.experts.gate_up_proj" if model_type == "qwen2_moe" else "layers.0.mlp.moe.experts.w1"
    assert len(adapter.expert_templates(fused) or ()) == (2 if model_type == "qwen2_moe" else 1)
    shards_read_equal_the_whole_conversion(tmp_path, monkeypatch, adapter, args, shapes)


def shards_read_equal_the_whole_conversion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, adapter: HFAdapter, args: Any, shapes: dict[str, torch.Size]
) -> None:
    """Random weights of ``shapes`` written through ``adapter``; every made-up shard read equals the same positions
    of ``from_hf`` of the whole checkpoint."""
    generator = torch.Generator().manual_seed(0)
    ours = {key: torch.randn(shape, generator=generator) for key, shape in shapes.items()}
    if adapter.tied(args):
        ours[adapter.output_key] = ours[adapter.embedding_key]
    hf = {k: v.contiguous() for k, v in adapter.to_hf(ours, args).items()}
    save_file(hf, str(tmp_path / "model.safetensors"))
    whole = adapter.from_hf(hf, args)

    shards = {key: made_up_shard(shape, generator) for key, shape in shapes.items()}
    expected, targets, by_target = {}, {}, {}
    for key, index in shards.items():
        value = whole[key]
        for dim, positions in enumerate(index):
            if positions is not None:
                value = value.index_select(dim, positions)
        expected[key], targets[key] = value, torch.full_like(value, float("nan"))
        by_target[id(targets[key])] = index

    # (Where a dimension is whole, the local size is the global one, which is all the loader reads of a shape.)
    monkeypatch.setattr(hf_stream, "local_indices", lambda target: by_target[id(target)])
    with SliceReader(tmp_path, dict.fromkeys(hf, "model.safetensors")) as reader:
        stream_into(targets, reader, adapter, args)
    for key in shapes:
        assert torch.equal(targets[key], expected[key]), key


@pytest.mark.parametrize("with_source", [False, True], ids=["fresh_layout", "source_layout"])
def test_export_block_by_block_writes_files_as_they_complete(tmp_path: Path, with_source: bool) -> None:
    """``save_hf_weights`` given blocks (as ``export_hf`` feeds it, one gathered block at a time) writes each file
    once it is complete, before the later blocks exist; the folder is byte-identical to saving the whole state dict."""
    from titanium.checkpoint.full_blocks import block_name
    from titanium.checkpoint.hf import HFCheckpoint, save_hf_weights
    from titanium.model_builder import ModelBuilder

    spec = get_model_spec("qwen3_moe")
    args = build_model_args(spec, "debugmodel_moe", vocab_size=64)
    state = ModelBuilder(torch.device("cpu"), seed=1).build(spec, args).model.state_dict()
    whole = save_hf_weights(state, tmp_path / "whole", spec.hf_adapter, args, max_shard_bytes=2 * 10**6)
    source = HFCheckpoint.open(whole) if with_source else None
    blocks: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        blocks.setdefault(block_name(key), {})[key] = value
    partial, written = tmp_path / ".blocks.partial", []

    def one_at_a_time():
        for block in blocks.values():
            written.append(len(list(partial.glob("*"))) if partial.exists() else 0)
            yield block

    out = save_hf_weights(
        one_at_a_time(), tmp_path / "blocks", spec.hf_adapter, args, source=source, max_shard_bytes=2 * 10**6
    )
    assert written[-1] >= 3 and written == sorted(written), written  # files appear while later blocks are pending
    names = sorted(p.name for p in whole.iterdir())
    assert sorted(p.name for p in out.iterdir()) == names and len(names) > 4
    for name in names:
        assert (out / name).read_bytes() == (whole / name).read_bytes(), name
