"""Quantized export for serving (``python -m titanium.tools.convert quantize``): the folder loads in
``transformers`` through its ``quantization_config`` (TorchAoConfig) and computes what titanium's model computes
after torchao's ``quantize_`` with the same scheme; a QAT-trained model exported with its scheme computes what its
fake-quantized training model computed.

Random fp32 checkpoints (Llama with GQA, so the q/k RoPE row order matters; Qwen3 with tied embeddings).

- Layer by layer, the loaded weights compute what titanium's quantized weights compute on the same input, random
  and the loaded model's own activations (q/k outputs in Hugging Face row order): max difference 8 epsilon of the
  dtype times the largest output (float32: 1e-6; measured 0: the same integers, scales and kernels).
- Logits: weight-only schemes within 1e-5 (measured ~1e-6). Schemes that quantize activations at run time
  round each token's activations to an int8 step, and a hidden state that differs in its last float32 bit
  between the two implementations can fall on the other side of a rounding step; from that token on, later
  positions differ (measured: int8 x int8, 3.4e-2 at positions after the first such token, against a
  quantization error of 0.11; 1e-6 before it). So for them the logits must only be closer to titanium's than
  the quantization error (half of it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.parity.harness import ParityCase, load_titanium, make_hf_checkpoint, random_tokens
from tests.parity.test_parity import VOCAB, llama, qwen3
from titanium.checkpoint.hf import export_hf
from titanium.checkpoint.quantized_export import quantize_model
from titanium.config.loader import ConfigError
from titanium.config.sections import QATSection
from titanium.models import get_model_spec
from titanium.quantize.qat import QATConverter
from titanium.quantize.schemes import SCHEMES, check_device, quantized_layers
from titanium.tools.convert import main

transformers = pytest.importorskip("transformers")

LLAMA, QWEN3_TIED = llama(n_kv_heads=2, tied=False), qwen3(tied=True)
WEIGHTS_TOL = 1e-5
CPU_SCHEMES = [name for name, scheme in SCHEMES.items() if scheme.cuda_capability is None]
CUDA_SCHEMES = [name for name, scheme in SCHEMES.items() if scheme.cuda_capability is not None]


def _assert_logits_close(diff: float, error: float, scheme: str, what: str) -> None:
    """``diff``: max abs logit difference from the reference; ``error``: the quantization's own (module doc)."""
    bound = error / 2 if "dynamic_activation" in scheme else WEIGHTS_TOL
    assert diff <= bound, f"{what} {scheme}: logits differ by {diff:.1e} (bound {bound:.1e})"
    assert error > 10 * WEIGHTS_TOL, f"{what} {scheme}: quantization changed the logits by only {error:.1e}"


def _quantize(source: Path, out: Path, model: str, scheme: str, *flags: str) -> int:
    return main(["quantize", str(source), str(out), "--model", model, "--scheme", scheme, *flags])


@torch.no_grad()
def _compare_export(
    case: ParityCase, source: Path, out: Path, scheme: str, device: str, dtype: torch.dtype
) -> tuple[float, float, float]:
    """Load ``out`` in transformers and check it layer by layer against titanium's quantized model; return the max
    abs logit difference between the two, the max abs change quantization made to titanium's logits, and the
    largest dense logit."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=dtype, device_map=device).eval()
    assert loaded.config.quantization_config.quant_method == "torchao"
    assert type(loaded.lm_head.weight) is nn.Parameter  # filtered: "output"
    model, args, _ = load_titanium(source, case)
    model = model.to(device, dtype)
    tokens = random_tokens(VOCAB, case.seq_len).to(device)
    dense = model(tokens).float()
    layers = quantized_layers(model, scheme, 32, ["output"])
    quantize_model(model, scheme, 32, layers)
    adapter = get_model_spec(case.model).hf_adapter
    inputs: dict[str, torch.Tensor] = {}  # each loaded layer's input in the loaded model's own forward
    hooks = [
        loaded.get_submodule(adapter.hf_key(f"{layer}.weight").removesuffix(".weight")).register_forward_pre_hook(
            lambda _, args, layer=layer: inputs.update({layer: args[0].reshape(-1, args[0].shape[-1])})
        )
        for layer in layers
    ]
    theirs = loaded(input_ids=tokens).logits.float()
    for hook in hooks:
        hook.remove()
    for layer in layers:
        ours = model.get_submodule(layer).weight
        hf_key = adapter.hf_key(f"{layer}.weight")
        theirs_weight = loaded.get_submodule(hf_key.removesuffix(".weight")).weight
        assert type(theirs_weight) is type(ours), (layer, type(theirs_weight), type(ours))
        random = torch.randn(5, ours.shape[1], generator=torch.Generator().manual_seed(0)).to(device, dtype)
        for x in (random, inputs[layer]):
            expected = adapter.to_hf({f"{layer}.weight": F.linear(x, ours).T}, args)[hf_key].T  # HF row order
            got = F.linear(x, theirs_weight)
            assert (got - expected).abs().max() <= 8 * torch.finfo(dtype).eps * expected.abs().max(), layer
    ours = model(tokens).float()
    return (theirs - ours).abs().max().item(), (ours - dense).abs().max().item(), dense.abs().max().item()


@pytest.mark.parametrize(
    ("case", "scheme"),
    [pytest.param(LLAMA, s, id=f"llama3-gqa-{s}") for s in CPU_SCHEMES]
    + [pytest.param(QWEN3_TIED, "int8_weight_only", id="qwen3-tied-int8_weight_only")],
)
def test_cpu_schemes_load_in_transformers_and_match_titanium(case: ParityCase, scheme: str, tmp_path: Path) -> None:
    source = tmp_path / "hf"
    make_hf_checkpoint(case, source)
    assert _quantize(source, tmp_path / "q", case.model, scheme, "--dtype", "float32") == 0
    assert not (tmp_path / ".q.partial").exists() and (tmp_path / "q/tokenizer_config.json").is_file()
    diff, error, _ = _compare_export(case, source, tmp_path / "q", scheme, "cpu", torch.float32)
    _assert_logits_close(diff, error, scheme, f"{case.id}: transformers vs titanium")


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", CUDA_SCHEMES)
def test_cuda_schemes_load_in_transformers_and_match_titanium(scheme: str, tmp_path: Path) -> None:
    """bfloat16 on the GPU: every loaded layer computes what titanium's computes on the loaded model's own
    activations (``_compare_export``), but the rest of each model rounds to bfloat16 in its own order (dense logits
    differ by ~3e-2 of 2.9), so the logits differ by more than in float32. Weight-only int4: within 2% of the
    largest logit (bfloat16 keeps 8 bits; measured 0.9-1.3%). Float8 also rounds each token's activations to e4m3
    (3 mantissa bits) at run time, which turns those bfloat16 differences into whole float8 steps (the module doc):
    its logits must only be closer to titanium's than the quantization's own change (measured on an H200: 0.51 and
    0.59 of it over two seeds)."""
    source = tmp_path / "hf"
    make_hf_checkpoint(LLAMA, source)
    assert _quantize(source, tmp_path / "q", "llama3", scheme) == 0  # (default dtype: bfloat16)
    diff, error, scale = _compare_export(LLAMA, source, tmp_path / "q", scheme, "cuda", torch.bfloat16)
    bound = error if "dynamic_activation" in scheme else 2e-2 * scale
    assert diff <= bound, f"{scheme}: transformers vs titanium logits differ by {diff:.1e} (bound {bound:.1e})"
    assert error > 2e-2 * scale, f"{scheme}: quantization changed the logits by only {error:.1e}"


@pytest.mark.parametrize("scheme", ["int4_weight_only", "int8_dynamic_activation_int4_weight"])
def test_qat_trained_model_exports_as_it_trained(scheme: str, tmp_path: Path) -> None:
    """A QAT model's dense HF export, quantized with its [qat] scheme, computes its fake-quantized logits."""
    source = tmp_path / "hf"
    make_hf_checkpoint(LLAMA, source)
    spec = get_model_spec("llama3")
    trained, args, _ = load_titanium(source, LLAMA)  # random weights stand in for trained ones
    with torch.device("meta"):
        model = spec.model_cls(args)
    QATConverter(QATSection(enable=True, scheme=scheme, group_size=32)).convert(model)
    model.load_state_dict(trained.state_dict(), assign=True)
    model.init_buffers("cpu")
    export_hf(model, tmp_path / "dense", spec.hf_adapter, args, source_folder=source)
    assert _quantize(tmp_path / "dense", tmp_path / "q", "llama3", scheme, "--dtype", "float32") == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()
    tokens = random_tokens(VOCAB, LLAMA.seq_len)
    with torch.no_grad():
        fake_quantized, theirs = model.eval()(tokens), loaded(input_ids=tokens).logits
        dense = trained(tokens)
    error = (fake_quantized - dense).abs().max().item()
    _assert_logits_close((theirs - fake_quantized).abs().max().item(), error, scheme, "export vs QAT fake-quantized")


def test_bad_scheme_input_is_one_message_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source = tmp_path / "hf"
    make_hf_checkpoint(LLAMA, source)
    capsys.readouterr()
    assert _quantize(source, tmp_path / "q", "llama3", "int4_weight_only", "--group-size", "48") == 2
    message = capsys.readouterr().err
    assert message.count("\n") == 1 and "Traceback" not in message
    assert "--group-size 48 does not divide the 64 inputs of layers.0.attention.wq; use a divisor of it" in message
    assert not (tmp_path / "q").exists() and not (tmp_path / ".q.partial").exists()
    assert _quantize(source, tmp_path / "q", "llama3", "int4_weight_only", "--filter-fqns") == 0  # output too
    assert _quantize(source, tmp_path / "q", "qwen3", "int8_weight_only") == 2
    assert "config.json: model_type 'llama' is not a qwen3 checkpoint ('qwen3'); use --model llama3" in (
        capsys.readouterr().err
    )
    for scheme in CUDA_SCHEMES:  # what this CPU machine (and any without CUDA) is told
        with pytest.raises(ConfigError, match=f"--scheme {scheme} needs a CUDA GPU .* on CPU use one of int4_weight"):
            check_device(scheme, torch.device("cpu"))
    with torch.device("meta"):
        tiny = nn.Sequential(nn.Linear(64, 40))
    with pytest.raises(ConfigError, match="0 is 40 x 64; scheme float8_dynamic_activation_float8_weight needs both"):
        quantized_layers(tiny, "float8_dynamic_activation_float8_weight", 32, [])
    with pytest.raises(ConfigError, match="--group-size 16: scheme int4_weight_only_tinygemm takes group sizes 32,"):
        quantized_layers(tiny, "int4_weight_only_tinygemm", 16, [])
