"""Regional compile keeps every parameter name, so loading by name (DCP, Hugging Face, LoRA) ignores it."""

from __future__ import annotations

import torch

from titanium.config.sections import ActivationCheckpointSection
from titanium.models import build_model_args, get_model_spec
from titanium.models.common.moe import moe_layers
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


def test_compiled_moe_model_trains_like_eager():
    """A Mixture-of-Experts model is compiled by parts (attention, router): under full activation checkpointing it
    gives eager's loss and gradients (float32, 1e-5) and counts each token once, as eager does."""
    spec = get_model_spec("qwen3_moe")
    args = build_model_args(spec, "debugmodel_moe", vocab_size=256, max_seq_len=32)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = spec.model_cls(args)
        model.init_weights()
        apply_activation_checkpointing(model, ActivationCheckpointSection(mode="full"))
        if compiled:
            apply_compile(model)
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1)[:-1], tokens.flatten()[1:])
        loss.backward()
        counts = [m.tokens_per_expert.clone() for m in moe_layers(model).values()]
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}, counts))
    (eager_loss, eager_grads, eager_counts), (loss, grads, counts) = results
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-5, atol=1e-5, msg=name)
    assert all(torch.equal(a, b) for a, b in zip(counts, eager_counts))
    top_k = next(iter(moe_layers(model).values())).args.top_k
    assert sum(int(c.sum()) for c in counts) == 2 * 32 * top_k * len(counts)
