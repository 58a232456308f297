"""The one model builder: layout-independent initialization, converters, and the hidden-states output.

Every module draws from a generator seeded by the run seed and its name, so a pipeline stage (or the
one-block-at-a-time init of a sharded model) gets exactly the weights a single process would. This is
the path every device takes (nothing is broadcast from rank 0), so checking it on CPU checks the GPU path.
"""

from __future__ import annotations

import dataclasses

import torch

from titanium.config.sections import LoRASection
from titanium.model_builder import ModelBuilder
from titanium.models import get_model_spec
from titanium.models.converter import unconverted
from titanium.parallel.pipeline import keep_only
from titanium.peft.converter import LoRAConverter

CPU = torch.device("cpu")


def _spec_args(name: str = "llama3"):
    spec = get_model_spec(name)
    return spec, dataclasses.replace(spec.flavors["debugmodel"], max_seq_len=32)


def test_a_pipeline_stage_initializes_the_weights_one_process_would():
    spec, args = _spec_args()
    whole = ModelBuilder(CPU, seed=7).build(spec, args).model.state_dict()
    with torch.device("meta"):
        meta = spec.model_cls(args)
    stage = keep_only(meta, ["3", "4"], first=False, last=True)
    stage.to_empty(device=CPU)
    stage.init_weights(buffer_device=CPU, seed=7)
    for name, value in stage.state_dict().items():
        assert torch.equal(value, whole[name]), name
    # corresponding blocks of different stages differ (each draws from its own stream)
    assert not torch.equal(whole["layers.3.attention.wq.weight"], whole["layers.4.attention.wq.weight"])
    other_seed = ModelBuilder(CPU, seed=8).build(spec, args).model.state_dict()
    assert not torch.equal(other_seed["layers.3.attention.wq.weight"], whole["layers.3.attention.wq.weight"])


def test_lora_converter_trains_adapters_only_and_can_switch_them_off():
    spec, args = _spec_args()
    lora = LoRASection(rank=4, alpha=8.0)
    base = ModelBuilder(CPU, seed=3).build(spec, args).model
    built = ModelBuilder(CPU, seed=3).build(spec, args, converters=[LoRAConverter(lora)])
    trainable = {n for n, p in built.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_a." in n or ".lora_b." in n for n in trainable)
    with torch.no_grad():
        for name, module in built.model.named_modules():
            if name.endswith("lora_b"):
                module.weight.normal_()  # as if trained: the adapted model now differs from the base
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    with torch.no_grad():
        expected = base(tokens)
        assert not torch.allclose(built.model(tokens), expected)
        with unconverted(built.converters, built.model):
            torch.testing.assert_close(built.model(tokens), expected, rtol=0, atol=0)
        assert not torch.allclose(built.model(tokens), expected)  # adapters back on


def test_hidden_states_through_the_projection_equal_the_logits():
    spec, args = _spec_args("qwen3")
    model = ModelBuilder(CPU, seed=1).build(spec, args).model
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    with torch.no_grad():
        hidden = model(tokens, project=False)
        assert hidden.shape == (2, 16, args.dim)
        torch.testing.assert_close(model.output(hidden).float(), model(tokens), rtol=0, atol=0)
