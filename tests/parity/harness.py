"""Parity harness: a titanium model loaded from a Hugging Face checkpoint must *be* the HF model.

Reusable for every family with an HF adapter: describe a tiny ``transformers`` config of the same
architecture (a ``ParityCase``) and call the checks below. Each check builds a random ``transformers``
model (every weight random, norm scales included, so a wrong permutation of a per-head weight
cannot hide behind ones), saves it as sharded safetensors, loads it through titanium's HF path and
compares.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open

from titanium.checkpoint.hf import INDEX_FILE, HFCheckpoint, save_hf_weights
from titanium.model_builder import ModelBuilder
from titanium.models import get_model_spec

LOGIT_ATOL = 1e-5
GRAD_ATOL = 1e-6


@dataclass(frozen=True)
class ParityCase:
    """One architecture variant: a titanium family and the ``transformers`` model that it mirrors."""

    id: str
    model: str
    """titanium registry name."""
    hf_model: Callable[[], type]
    """Returns the ``transformers`` class (imported lazily so collection never needs transformers)."""
    hf_config: Callable[[], Any]
    """Returns a small ``transformers`` config object."""
    seq_len: int = 24
    extra: dict[str, Any] = field(default_factory=dict)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random: matrices N(0, 0.08), vectors (norm scales) U(0.5, 1.5)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)


def make_hf_checkpoint(case: ParityCase, folder: Path, seed: int = 0, max_shard_size: str = "40KB") -> Any:
    """Save a random fp32 ``transformers`` model of ``case`` to ``folder`` (sharded); return the model."""
    torch.manual_seed(seed)
    config = case.hf_config()
    model = case.hf_model()(config).float().eval()
    randomize_(model, seed)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}))
    return model


def load_titanium(folder: Path, case: ParityCase) -> tuple[torch.nn.Module, Any, Any]:
    built = ModelBuilder(torch.device("cpu")).load_hf(get_model_spec(case.model), folder, max_seq_len=64)
    return built.model.eval(), built.args, HFCheckpoint.open(folder)


def random_tokens(vocab: int, seq_len: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(seed))


def max_logit_diff(hf_model: Any, model: torch.nn.Module, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        expected = hf_model(input_ids=tokens).logits.float()
        ours = model(tokens)
    assert ours.shape == expected.shape
    return (ours - expected).abs().max().item()


def grad_diffs(case: ParityCase, hf_model: Any, model: torch.nn.Module, args: Any, tokens: torch.Tensor) -> dict:
    """Max abs gradient difference per HF parameter name after one next-token loss backward."""
    adapter = get_model_spec(case.model).hf_adapter
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    hf_model.zero_grad()
    model.zero_grad()
    hf_logits = hf_model(input_ids=inputs).logits.float()
    F.cross_entropy(hf_logits.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).backward()
    ours = adapter.to_hf({name: p.grad for name, p in model.named_parameters(remove_duplicate=False)}, args)
    expected = {name: p.grad for name, p in hf_model.named_parameters()}
    assert set(ours) == set(expected), set(ours) ^ set(expected)
    return {name: (ours[name] - expected[name]).abs().max().item() for name in expected}


def read_all(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """file name -> {key: tensor} for every safetensors file in ``folder``."""
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out[path.name] = {k: f.get_tensor(k) for k in f.keys()}
    return out


def assert_round_trip(
    case: ParityCase, source: Path, out: Path, model: torch.nn.Module, args: Any, ckpt: Any, adapter: Any = None
) -> None:
    """Saving back gives the source's files, keys, tensors (bitwise, fp32), index and config (``adapter``: the
    family's unless given, e.g. a reward model's)."""
    adapter = adapter or get_model_spec(case.model).hf_adapter
    save_hf_weights(model.state_dict(), out, adapter, args, dtype=torch.float32, source=ckpt)
    original, saved = read_all(source), read_all(out)
    assert list(saved) == list(original)
    for name, tensors in original.items():
        assert list(sorted(saved[name])) == list(sorted(tensors)), name
        for key, value in tensors.items():
            assert saved[name][key].dtype == value.dtype, key
            assert torch.equal(saved[name][key], value), key
    if (source / INDEX_FILE).exists():
        assert json.loads((out / INDEX_FILE).read_text()) == json.loads((source / INDEX_FILE).read_text())
    else:
        assert not (out / INDEX_FILE).exists()
    assert json.loads((out / "config.json").read_text()) == json.loads((source / "config.json").read_text())
    for side in ("generation_config.json", "tokenizer_config.json"):  # (classifiers have no generation config)
        assert (out / side).exists() == (source / side).exists(), side
        if (source / side).exists():
            assert (out / side).read_bytes() == (source / side).read_bytes()
