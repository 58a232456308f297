"""Regional compile keeps every parameter name, so loading by name (DCP, Hugging Face, LoRA) ignores it."""

from __future__ import annotations

import torch

from titanium.config.sections import ActivationCheckpointSection
from titanium.models import build_model_args, get_model_spec
from titanium.parallel.activation_checkpoint import apply_activation_checkpointing
from titanium.parallel.compile import apply_compile


def test_compiled_blocks_keep_their_names():
    spec = get_model_spec("llama3")
    with torch.device("meta"):
        model = spec.model_cls(build_model_args(spec, "debugmodel", vocab_size=256, max_seq_len=64))
    names = list(model.state_dict())
    apply_activation_checkpointing(model, ActivationCheckpointSection(mode="full"))
    apply_compile(model)  # lazy: nothing is compiled until the first call
    assert list(model.state_dict()) == names
    assert not [n for n, _ in model.named_parameters() if "_orig_mod" in n]
    assert all(block._compiled_call_impl is not None for block in model.layers.values())
