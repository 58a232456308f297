"""Activation checkpointing: every mode gives the eager gradients, and checkpoint names do not change."""

from __future__ import annotations

import pytest
import torch

from titanium.config.sections import ActivationCheckpointSection
from titanium.models.llama3 import Llama3Args, Transformer
from titanium.parallel import activation_checkpoint as ac
from titanium.parallel.activation_checkpoint import apply_activation_checkpointing

ARGS = Llama3Args(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=32)


def model_and_grads(cfg: ActivationCheckpointSection | None) -> tuple[Transformer, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    if cfg is not None:
        apply_activation_checkpointing(model, cfg)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    model(tokens).logsumexp(-1).sum().backward()
    return model, {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "mode, option, wrapped",
    [("full", "op", [0, 1, 2, 3]), ("selective", "op", [0, 1, 2, 3]), ("selective", "2", [0, 2])],
)
def test_checkpointing_keeps_gradients_and_names(mode, option, wrapped, monkeypatch):
    seen_ops = set()
    policy = ac._op_sac_policy

    def spy(save, ctx, op, *args, **kwargs):
        seen_ops.add(op)
        return policy(save, ctx, op, *args, **kwargs)

    monkeypatch.setattr(ac, "_op_sac_policy", spy)
    _, reference = model_and_grads(None)
    model, grads = model_and_grads(ActivationCheckpointSection(mode=mode, selective_ac_option=option))
    is_wrapped = [type(b).__name__ == "CheckpointWrapper" for b in model.layers.values()]
    assert [i for i, w in enumerate(is_wrapped) if w] == wrapped
    assert model.state_dict().keys() == Transformer(ARGS).state_dict().keys()
    for name, ref in reference.items():
        torch.testing.assert_close(grads[name], ref, rtol=0, atol=0, msg=name)
    if option == "op" and mode == "selective":
        saved = ac._ops_to_save() & seen_ops
        assert torch.ops.aten.mm.default in saved
        assert any("scaled_dot_product" in str(op) for op in saved)  # the CPU SDPA op is saved, not recomputed
