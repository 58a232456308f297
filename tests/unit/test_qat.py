"""Quantization-aware training: prepare -> train -> convert/export -> load, LoRA on QAT layers, config errors.

The reference for the exported model is the fake-quantized model it was trained as: torchao's convert applies
the same integer grid the fake quantizers simulated, so the quantized model's logits must equal the fake-
quantized model's (tolerance 1e-5 relative; measured: bitwise equal on CPU), while both differ from the
high-precision weights' logits (QAT really quantizes).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tests.helpers import scalars, tiny_args
from titanium.config import load_config
from titanium.config.loader import ConfigError
from titanium.config.sections import LoRASection, QATSection
from titanium.models import build_model_args, get_model_spec
from titanium.models.converter import unconverted
from titanium.parallel.distributed import shutdown_distributed
from titanium.peft.lora import apply_lora, init_lora
from titanium.quantize.qat import LoRAFakeQuantizedLinear, QATConverter, load_quantized, qat_layers


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _trained(make_trainer, folder, *flags):
    trainer = make_trainer(*tiny_args(folder, "--training.steps", "3", "--qat.enable", *flags))
    trainer.train()
    return trainer


def test_prepare_train_convert_round_trip(make_trainer, tmp_path):
    trainer = _trained(make_trainer, tmp_path / "qat")
    from torchao.quantization.qat import FakeQuantizedLinear

    fake = [n for n, m in trainer.model.named_modules() if isinstance(m, FakeQuantizedLinear)]
    assert len(fake) == 6 * 7 and type(trainer.model.output) is nn.Linear  # every block linear; output filtered
    assert all(torch.isfinite(torch.tensor(v)) for v in scalars(tmp_path / "qat/tb").values())
    info = json.loads((tmp_path / "qat/quantized/quantization.json").read_text())
    assert info["scheme"] == "int8_dynamic_activation_int4_weight" and len(info["layers"]) == 42

    tokens = torch.randint(0, trainer.model_args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.device("meta"):
        deployed = trainer.model_spec.model_cls(trainer.model_args)
    load_quantized(deployed, tmp_path / "qat/quantized")
    assert type(deployed.layers["0"].attention.wq.weight).__name__ == "IntxUnpackedToInt8Tensor"
    with torch.no_grad():
        fake_quantized = trainer.model(tokens)
        with unconverted(trainer.built.converters, trainer.model):
            high_precision = trainer.model(tokens)
        quantized = deployed(tokens)
    torch.testing.assert_close(quantized, fake_quantized, rtol=1e-5, atol=1e-5)
    assert _rel(fake_quantized, high_precision) > 1e-3  # int4 weights and int8 activations do change the logits


def test_lora_adapts_the_fake_quantized_layers(make_trainer, tmp_path):
    """SFT with QAT and LoRA: the adapted layers are LoRA-over-fake-quant, only adapters train, and both the
    PEFT adapter and the quantized base are exported."""
    sft = (
        "--training.objective", "sft",
        "--data.kind", "chat",
        "--data.path", "assets/tasks/arithmetic/train.jsonl",
        "--chat.chat_template", "llama3",
        "--lora.rank", "4",
    )  # fmt: skip
    trainer = _trained(make_trainer, tmp_path / "qlora", *sft)
    wq = trainer.model.layers["0"].attention.wq
    assert type(wq) is LoRAFakeQuantizedLinear and wq.weight_fake_quantizer is not None
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    assert (tmp_path / "qlora/adapter/adapter_model.safetensors").is_file()
    info = json.loads((tmp_path / "qlora/quantized/quantization.json").read_text())
    assert "layers.0.attention.wq" in info["layers"]
    trainer.close()
    shutdown_distributed()


def _meta_llama():
    spec = get_model_spec("llama3")
    with torch.device("meta"):
        return spec.model_cls(build_model_args(spec, "debugmodel"))


def test_lora_over_qat_computes_fake_quantized_base_plus_adapter():
    torch.manual_seed(0)
    model = _meta_llama()
    qat = QATConverter(QATSection(enable=True))
    qat.convert(model)
    apply_lora(model, LoRASection(rank=4, target_modules=["wq"]))
    model.to_empty(device="cpu")
    model.init_weights(buffer_device="cpu", seed=0)
    init_lora(model, seed=0)
    wq = model.layers["0"].attention.wq
    nn.init.normal_(wq.lora_b.weight)  # a trained adapter
    x = torch.randn(3, 256)
    from torchao.quantization.qat import FakeQuantizedLinear

    base = FakeQuantizedLinear.forward(wq, x)
    torch.testing.assert_close(wq(x), base + wq.lora_b(wq.lora_a(x)) * wq.lora_scale)
    assert _rel(base, nn.functional.linear(x, wq.weight)) > 1e-3  # the base is fake-quantized
    with qat.without_conversion(model):  # fake quantization off: the high-precision base
        torch.testing.assert_close(FakeQuantizedLinear.forward(wq, x), nn.functional.linear(x, wq.weight))
    dora_model = _meta_llama()
    qat.convert(dora_model)
    with pytest.raises(ConfigError, match="--lora.use_dora: 'layers.0.attention.wq' is a FakeQuantizedLinear"):
        apply_lora(dora_model, LoRASection(rank=4, target_modules=["wq"], use_dora=True))


def test_layers_that_cannot_be_quantized_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="group_size 48 does not divide the 256 inputs of layers.0.attention.wq"):
        qat_layers(_meta_llama(), QATSection(enable=True, group_size=48))
    spec = get_model_spec("qwen3")
    with torch.device("meta"):
        tied = spec.model_cls(build_model_args(spec, "debugmodel"))
    with pytest.raises(ConfigError, match="output shares its weight with the embedding"):
        qat_layers(tied, QATSection(enable=True, filter_fqns=[]))
    with pytest.raises(ConfigError, match="--qat.enable does not compose with --parallelism.tensor_parallel_degree"):
        load_config(tiny_args(tmp_path, "--qat.enable", "--parallelism.tensor_parallel_degree", "2"))
    with pytest.raises(ConfigError, match="--qat.group_size must be >= 1"):
        load_config(tiny_args(tmp_path, "--qat.enable", "--qat.group_size", "0"))
