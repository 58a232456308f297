"""HF checkpoint plumbing: adapters, config checks, bad folders, export layouts, the HF tokenizer."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from titanium.checkpoint.hf import (
    HFCheckpoint,
    HFCheckpointError,
    hf_model_args,
    load_hf_weights,
    save_hf_weights,
)
from titanium.model_builder import ModelBuilder
from titanium.models import get_model_spec
from titanium.models.hf_adapter import HFConfigError, rope_rows_from_hf, rope_rows_to_hf
from titanium.models.llama3 import LLAMA3_FLAVORS, Transformer
from titanium.models.llama3.hf import LLAMA3_HF_ADAPTER
from titanium.models.qwen3 import QWEN3_FLAVORS, Qwen3Transformer
from titanium.models.qwen3.hf import QWEN3_HF_ADAPTER

LLAMA = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], n_layers=2, vocab_size=300, max_seq_len=64)
QWEN = dataclasses.replace(QWEN3_FLAVORS["debugmodel"], n_layers=2, vocab_size=300, max_seq_len=64)


def _model(cls: type, args, seed: int = 0) -> torch.nn.Module:
    model = cls(args)
    torch.manual_seed(seed)
    model.init_weights()
    with torch.no_grad():  # norm scales random too, so permutation mistakes show
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


def _save(model, args, adapter, folder: Path, shard_bytes: int = 200_000) -> HFCheckpoint:
    save_hf_weights(model.state_dict(), folder, adapter, args, max_shard_bytes=shard_bytes)
    return HFCheckpoint.open(folder)


def test_rope_permutation_is_a_per_head_inverse_pair() -> None:
    w = torch.arange(3 * 8 * 5, dtype=torch.float32).view(3 * 8, 5)
    hf = rope_rows_to_hf(w, head_dim=8)
    assert torch.equal(rope_rows_from_hf(hf, head_dim=8), w)
    # Head 0: our rows (0,1),(2,3),... are pairs; HF puts pair i's halves at rows i and i + 4.
    assert hf[:8, 0].tolist() == [w[r, 0].item() for r in (0, 2, 4, 6, 1, 3, 5, 7)]
    assert torch.equal(hf[8:16], rope_rows_to_hf(w[8:16], head_dim=8))  # heads are independent
    norm = torch.arange(8.0)
    assert torch.equal(rope_rows_from_hf(rope_rows_to_hf(norm, 8), 8), norm)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_adapter_round_trip(family: str, tied: bool) -> None:
    cls, base, adapter = {
        "llama3": (Transformer, LLAMA, LLAMA3_HF_ADAPTER),
        "qwen3": (Qwen3Transformer, QWEN, QWEN3_HF_ADAPTER),
    }[family]
    args = dataclasses.replace(base, tie_word_embeddings=tied)
    state = _model(cls, args).state_dict()
    hf = adapter.to_hf(state, args)
    assert ("lm_head.weight" in hf) == (not tied)
    assert all(k.startswith(("model.", "lm_head.")) for k in hf)
    back = adapter.from_hf(hf, args)
    assert set(back) == set(state)
    for key, value in state.items():
        assert torch.equal(back[key], value), key
    # The q/k projections really are permuted (otherwise the test above proves little).
    assert not torch.equal(hf["model.layers.0.self_attn.q_proj.weight"], state["layers.0.attention.wq.weight"])
    assert adapter.to_hf_config(args)["tie_word_embeddings"] is tied
    rebuilt = adapter.from_hf_config(adapter.to_hf_config(args))
    assert adapter.config_fields(rebuilt) == adapter.config_fields(args)
    assert (rebuilt.vocab_size, rebuilt.max_seq_len) == (args.vocab_size, args.max_seq_len)


def test_args_come_from_config_json(tmp_path: Path) -> None:
    """Any shape of a supported family loads (a flavor is a preset, not a requirement); real mismatches name
    the file and the field."""
    args = _save_model_folder(tmp_path, LLAMA)
    spec = get_model_spec("llama3")
    resolved = hf_model_args(spec, tmp_path, tokenizer_vocab=290, max_seq_len=32)
    assert resolved == dataclasses.replace(args, max_seq_len=32, ffn_hidden_dim=args.ffn_dim)
    config = json.loads((tmp_path / "config.json").read_text())
    differences = spec.hf_adapter.differences(config, LLAMA3_FLAVORS["1B"])
    assert differences[:2] == ["hidden_size 256 != dim 2048", "num_hidden_layers 2 != n_layers 16"]
    with pytest.raises(HFCheckpointError, match="tokenizer has 301 ids but .* vocab_size 300"):
        hf_model_args(spec, tmp_path, tokenizer_vocab=301)
    with pytest.raises(HFConfigError) as err:
        hf_model_args(get_model_spec("qwen3"), tmp_path, option="--kd.teacher_path", family_option="--kd.teacher_model")
    assert str(err.value) == (
        f"--kd.teacher_path: {tmp_path / 'config.json'}: model_type 'llama' is not a qwen3 checkpoint ('qwen3'); "
        "use --kd.teacher_model llama3"
    )
    with pytest.raises(HFConfigError) as err:  # (no setting picks the family: a value model is the policy's)
        hf_model_args(get_model_spec("qwen3"), tmp_path, option="--ppo.value_model_path")
    assert str(err.value).endswith("; point --ppo.value_model_path at a qwen3 checkpoint (this one is llama3)")
    (tmp_path / "config.json").write_text(json.dumps({**config, "attention_bias": True, "num_attention_heads": 5}))
    with pytest.raises(HFConfigError, match=f"^{tmp_path / 'config.json'}: attention_bias = true is not supported"):
        hf_model_args(spec, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_attention_heads": 5, "head_dim": None}))
    with pytest.raises(HFConfigError, match=r"config.json: dim \(256\) must be divisible by n_heads \(5\)"):
        hf_model_args(spec, tmp_path)
    del config["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFConfigError, match="config.json: missing field 'hidden_size'"):
        hf_model_args(spec, tmp_path)


def _save_model_folder(folder: Path, args) -> object:
    model = _model(Transformer, args)
    _save(model, args, LLAMA3_HF_ADAPTER, folder)
    return args


def test_missing_extra_and_misshapen_keys_are_named(tmp_path: Path) -> None:
    args = _save_model_folder(tmp_path / "ok", LLAMA)
    ckpt = HFCheckpoint.open(tmp_path / "ok")
    assert len(ckpt.files) >= 2 and (tmp_path / "ok/model.safetensors.index.json").is_file()

    def broken(name: str, edit) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        for f in (tmp_path / "ok").iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        edit(folder, index)
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        return folder

    def drop(folder: Path, index: dict) -> None:
        file = index["weight_map"].pop("model.layers.1.mlp.up_proj.weight")
        tensors = load_file(folder / file)
        del tensors["model.layers.1.mlp.up_proj.weight"]
        save_file(tensors, folder / file)

    def add(folder: Path, index: dict) -> None:
        save_file({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4)}, folder / "extra.safetensors")
        index["weight_map"]["model.layers.0.self_attn.rotary_emb.inv_freq"] = "extra.safetensors"

    def reshape(folder: Path, index: dict) -> None:
        file = index["weight_map"]["model.norm.weight"]
        tensors = load_file(folder / file)
        tensors["model.norm.weight"] = torch.ones(17)
        save_file(tensors, folder / file)

    for name, edit, expected in [
        ("missing", drop, "missing keys: model.layers.1.mlp.up_proj.weight"),
        ("extra", add, "unexpected keys: model.layers.0.self_attn.rotary_emb.inv_freq"),
        ("shape", reshape, "shape mismatch: model.norm.weight [17] (model expects [256])"),
    ]:
        folder = broken(name, edit)
        with pytest.raises(HFCheckpointError, match="does not fit the model") as err:
            load_hf_weights(Transformer(args), folder, LLAMA3_HF_ADAPTER, args)
        assert expected in str(err.value), str(err.value)


def test_bad_folders(tmp_path: Path) -> None:
    with pytest.raises(HFCheckpointError, match="folder not found"):
        HFCheckpoint.open(tmp_path / "nope")
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled/config.json").write_text("{}")
    (tmp_path / "pickled/pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(HFCheckpointError, match="pytorch_model.bin: pickled weights are never loaded"):
        HFCheckpoint.open(tmp_path / "pickled")
    _save_model_folder(tmp_path / "trunc", LLAMA)
    shard = sorted((tmp_path / "trunc").glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(HFCheckpointError, match=f"{shard.name}: not a readable safetensors file"):
        HFCheckpoint.open(tmp_path / "trunc")
    (tmp_path / "noconfig").mkdir()
    with pytest.raises(HFCheckpointError, match="config.json not found"):
        HFCheckpoint.open(tmp_path / "noconfig")


def test_export_dtype_and_default_layout(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import transformers

    args = dataclasses.replace(QWEN, tie_word_embeddings=False)
    model = _model(Qwen3Transformer, args).eval()
    save_hf_weights(model.state_dict(), tmp_path / "single", QWEN3_HF_ADAPTER, args, dtype=torch.bfloat16)
    assert sorted(p.name for p in (tmp_path / "single").iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "single/config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(tmp_path / "single/model.safetensors").values())

    ckpt = _save(model, args, QWEN3_HF_ADAPTER, tmp_path / "sharded", shard_bytes=300_000)
    assert len(ckpt.files) >= 2 and ckpt.files[0] == f"model-00001-of-{len(ckpt.files):05d}.safetensors"
    # transformers reads our fresh config.json and weights as the same model.
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "sharded").eval()
    tokens = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=tokens).logits, model(tokens), atol=1e-4, rtol=0)
    built = ModelBuilder(torch.device("cpu")).load_hf(get_model_spec("qwen3"), tmp_path / "sharded", max_seq_len=64)
    reloaded, reloaded_args = built.model, built.args
    assert reloaded_args == args  # Qwen3's args are exactly its config.json
    for key, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key


def test_tied_source_with_stored_lm_head_round_trips(tmp_path: Path) -> None:
    """Some exporters store lm_head even when tied: loading ignores it, saving writes it back."""
    args = dataclasses.replace(LLAMA, tie_word_embeddings=True)
    model = _model(Transformer, args)
    save_hf_weights(model.state_dict(), tmp_path / "src", LLAMA3_HF_ADAPTER, args)
    tensors = load_file(tmp_path / "src/model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, tmp_path / "src/model.safetensors", metadata={"format": "pt"})
    loaded = Transformer(args)
    ckpt = load_hf_weights(loaded, tmp_path / "src", LLAMA3_HF_ADAPTER, args)
    assert loaded.output.weight is loaded.tok_embeddings.weight
    save_hf_weights(loaded.state_dict(), tmp_path / "out", LLAMA3_HF_ADAPTER, args, source=ckpt)
    out = load_file(tmp_path / "out/model.safetensors")
    assert set(out) == set(tensors) and all(torch.equal(out[k], v) for k, v in tensors.items())
