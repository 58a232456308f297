"""Quantized checkpoints load as the weights they stand for, per rank and per slice, in the native families and the
transformers backend, and export unquantized: block-wise FP8 (DeepSeek-V3's, the Qwen3 ``-FP8`` models') and MXFP4
experts (GPT-OSS's).

- A tiny DeepSeek-V3 (backend: latent attention, per-expert MoE tensors) and a Qwen3 debug model (native: RoPE-
  permuted q/k rows read in whole heads) saved by ``transformers`` and rewritten in FP8 with 8 x 8 blocks: titanium's
  logits equal those of ``transformers``' own loading of the FP8 folder (which dequantizes on CPU), fp32 1e-5
  (measured: 0 for the backend, 9e-6 for the native family's own forward); the export holds exactly the dequantized
  tensors, without scales or ``quantization_config``, and reloads with the same logits.
- One weight with partial blocks (20 x 36 in 16 x 16 blocks, the ceiling grid of the format): every slice a rank
  may read (a box, strided rows or columns, the whole) is that slice of the dequantized weight, exactly.
- A tiny GPT-OSS with MXFP4 experts: logits equal ``transformers``' loading of the folder exactly, every slice too.
- Other quantizations (GPTQ, bitsandbytes...) are refused before any process starts, naming the method.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.e2e.test_hf_train import make_hf_debug_checkpoint
from tests.helpers import tiny_args
from tests.objectives.fp8_checkpoints import dequantized, quantize_blocks, quantize_folder
from tests.objectives.tiny_backend import VOCAB, save_tiny_hf
from titanium.checkpoint.hf import HFCheckpoint, export_hf, hf_model_args, load_hf_weights, read_hf_config
from titanium.checkpoint.hf_quantized import Quantized
from titanium.checkpoint.hf_stream import SliceReader
from titanium.models import get_model_spec

transformers = pytest.importorskip("transformers")

BLOCK = (8, 8)
"""Divides every dimension of the tiny models: ``transformers``' CPU dequantization derives the block from the
scales' grid (rows // grid rows), which is the format's block only where the blocks are whole."""


def built(model: str, source: Path):
    """The model titanium builds from ``source`` (the native family for Qwen3, else the backend), its
    checkpoint adapter and args."""
    native = model == "qwen3"
    spec = get_model_spec(model if native else "transformers")
    adapter = spec.hf_adapter if native else spec.hf_adapter.for_config(read_hf_config(source))  # (per expert)
    args = hf_model_args(spec, source)
    with torch.device("meta"):
        ours = spec.model_cls(args)
    ours.to_empty(device="cpu")
    ours.init_weights(seed=0)
    return ours, adapter, args


@pytest.mark.parametrize("model", ["deepseek_v3", "qwen3"])
def test_fp8_checkpoints_load_as_transformers_dequantizes_them(tmp_path: Path, model: str) -> None:
    source = tmp_path / "fp8"
    if model == "qwen3":
        make_hf_debug_checkpoint(source, "qwen3")  # (2 MB shards: an index, scales in several files)
    else:
        save_tiny_hf(source, model)
    quantize_folder(source, BLOCK)
    reference = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    ours, adapter, args = built(model, source)
    load_hf_weights(ours, source, adapter, args)
    x = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=x).logits
        torch.testing.assert_close(ours.eval()(x), expected, atol=1e-5, rtol=1e-5)
    export_hf(ours, tmp_path / "export", adapter, args, source_folder=source)
    exported = HFCheckpoint.open(tmp_path / "export")
    assert "quantization_config" not in json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported.quantized is None and set(exported.shapes) == set(HFCheckpoint.open(source).shapes)
    weights, stands_for = exported.read(), HFCheckpoint.open(source).read()  # (the source's read dequantized)
    for key, value in stands_for.items():
        assert torch.equal(weights[key], value.float()), key
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=x).logits, expected, atol=1e-6, rtol=1e-6)


def test_every_slice_is_read_dequantized(tmp_path: Path) -> None:
    weight = torch.randn(20, 36, generator=torch.Generator().manual_seed(0))
    block = (16, 16)
    quantized, scales = quantize_blocks(weight, block)
    assert scales.shape == (2, 3)  # (the ceiling grid: partial last blocks)
    save_file({"w": quantized, "w_scale_inv": scales}, tmp_path / "model.safetensors")
    whole = dequantized(quantized, scales, block)
    assert (whole - weight).abs().max() < 0.1 * weight.abs().max()  # (it is the weight, to FP8's precision)
    found = Quantized("fp8", {"w": ("w", "w_scale_inv")}, {"w": (20, 36)}, block)
    rows, strided = torch.arange(5, 17), torch.tensor([0, 3, 17, 35])
    with SliceReader(tmp_path, dict.fromkeys(["w", "w_scale_inv"], "model.safetensors"), found) as reader:
        for index in (None, [rows, None], [None, strided], [rows, strided], [torch.tensor([19]), torch.arange(36)]):
            expected = whole if index is None else whole[index[0] if index[0] is not None else slice(None)]
            if index is not None and index[1] is not None:
                expected = expected[:, index[1]]
            assert torch.equal(reader.read("w", index), expected), index


def test_other_quantizations_are_refused(tmp_path: Path, capsys, monkeypatch) -> None:
    from titanium.preflight import main as preflight

    source = tmp_path / "gptq"
    make_hf_debug_checkpoint(source, "qwen3")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (source / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("WORLD_SIZE", "1")
    start = ("--checkpoint.initial_load_path", str(source), "--checkpoint.initial_load_in_hf")
    assert preflight(tiny_args(tmp_path / "run", *start)) == 2
    err = capsys.readouterr().err
    assert f"{source / 'config.json'}: quantization_config has quant_method 'gptq'" in err, err
    assert "start from the model's unquantized (bf16) checkpoint" in err and "Traceback" not in err


def test_deepseeks_multi_token_prediction_layer_is_skipped(tmp_path: Path) -> None:
    """DeepSeek-V3's published folder holds its multi-token-prediction layer (``model.layers.61.*``, past the
    config's layers), which ``transformers`` skips on loading: titanium skips it too (it was refused as unexpected
    keys), FP8 scales and all, and the export leaves it out, as ``transformers``' own save does."""
    from safetensors.torch import load_file

    source = tmp_path / "fp8"
    save_tiny_hf(source, "deepseek_v3")
    tensors = load_file(source / "model.safetensors")
    tensors["model.layers.61.eh_proj.weight"] = torch.randn(64, 128)
    tensors["model.layers.61.enorm.weight"] = torch.ones(64)
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    quantize_folder(source, BLOCK)
    assert "model.layers.61.eh_proj.weight_scale_inv" in HFCheckpoint.open(source).stored_files
    reference = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    ours, adapter, args = built("deepseek_v3", source)
    load_hf_weights(ours, source, adapter, args)
    x = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(x), reference(input_ids=x).logits, atol=1e-6, rtol=1e-6)
    export_hf(ours, tmp_path / "export", adapter, args, source_folder=source)
    exported = HFCheckpoint.open(tmp_path / "export").shapes
    assert not [key for key in exported if key.startswith("model.layers.61.")]
    assert set(exported) == {k for k in HFCheckpoint.open(source).shapes if not k.startswith("model.layers.61.")}


def test_gpt_oss_mxfp4_experts_load_as_transformers_dequantizes_them(tmp_path: Path) -> None:
    """A tiny GPT-OSS whose experts are stored in MXFP4 as its published checkpoints are (``gate_up_proj_blocks`` /
    ``_scales``...): titanium's logits equal ``transformers``' own loading of the folder (which dequantizes on CPU),
    exactly; every slice a rank may read of a stacked expert weight is that slice of the whole dequantized weight; the
    export names the experts as in memory (``gate_up_proj``), without ``quantization_config``, and reloads with the
    same logits."""
    from tests.objectives.fp8_checkpoints import quantize_experts_mxfp4

    source = tmp_path / "mxfp4"
    save_tiny_hf(source, "gpt_oss")
    quantize_experts_mxfp4(source)
    checkpoint = HFCheckpoint.open(source)
    key = "model.layers.0.mlp.experts.gate_up_proj"
    assert checkpoint.quantized is not None and checkpoint.shapes[key] == (4, 64, 128)  # (experts, hidden, 2 x 64)
    reference = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    ours, adapter, args = built("gpt_oss", source)
    load_hf_weights(ours, source, adapter, args)
    x = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=x).logits
        torch.testing.assert_close(ours.eval()(x), expected, atol=0, rtol=0)
    whole = checkpoint.read([key])[key]
    torch.testing.assert_close(whole, reference.model.layers[0].mlp.experts.gate_up_proj, atol=0, rtol=0)
    experts, columns, rows = torch.tensor([3, 1]), torch.tensor([0, 31, 32, 63, 5]), torch.arange(40, 128)
    with checkpoint.reader() as reader:
        for index in ([experts, None, None], [None, columns, None], [None, None, rows], [experts, columns, rows]):
            expected_slice = whole
            for dim, positions in enumerate(index):
                expected_slice = expected_slice if positions is None else expected_slice.index_select(dim, positions)
            assert torch.equal(reader.read(key, index), expected_slice), index
    export_hf(ours, tmp_path / "export", adapter, args, source_folder=source)
    exported = HFCheckpoint.open(tmp_path / "export")
    assert exported.quantized is None and key in exported.shapes and f"{key}_blocks" not in exported.shapes
    assert "quantization_config" not in json.loads((tmp_path / "export" / "config.json").read_text())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=x).logits, expected, atol=0, rtol=0)
