"""Llama 3 model, shared layers, RoPE and FLOP counting."""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import titanium.models
from titanium.models.common.attention import Attention, AttentionInputs
from titanium.models.common.feed_forward import llama_ffn_hidden_dim
from titanium.models.common.norm import RMSNorm
from titanium.models.common.rope import RopeScaling, precompute_rope_tables, rope_inv_freq
from titanium.models.flops import count_params, count_params_on_meta, decoder_flops_per_token
from titanium.models.llama3 import LLAMA3_FLAVORS, Llama3Args, Transformer, llama3_flops_per_token

DEBUG = LLAMA3_FLAVORS["debugmodel"]


def _small_args(**overrides: object) -> Llama3Args:
    """A debugmodel shrunk further so per-test builds stay in the milliseconds."""
    base = dataclasses.replace(DEBUG, n_layers=2, max_seq_len=64)
    return dataclasses.replace(base, **overrides)


def _built(args: Llama3Args, seed: int = 0) -> Transformer:
    model = Transformer(args)
    model.init_weights(seed=seed)
    return model


def test_forward_shapes_and_backward() -> None:
    model = _built(DEBUG)
    tokens = torch.randint(0, DEBUG.vocab_size, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, DEBUG.vocab_size)
    assert logits.dtype == torch.float32
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    loss.backward()
    assert math.isfinite(loss.item())
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name


def test_positions_argument() -> None:
    model = _built(_small_args())
    tokens = torch.randint(0, DEBUG.vocab_size, (2, 12))
    with torch.no_grad():
        default = model(tokens)
        assert torch.equal(model(tokens, positions=torch.arange(12)), default)
        assert torch.equal(model(tokens, positions=torch.arange(12).expand(2, 12)), default)
        # RoPE only sees relative positions, so a uniform shift changes nothing but rounding.
        torch.testing.assert_close(model(tokens, positions=torch.arange(12) + 5), default)
        # Positions restarting mid-sequence (packed documents) do change the result.
        restarted = torch.cat([torch.arange(6), torch.arange(6)])
        assert not torch.allclose(model(tokens, positions=restarted), default, atol=1e-4)
        # Per-sample positions apply per sample.
        mixed = torch.stack([torch.arange(12), restarted])
        out = model(tokens, positions=mixed)
        torch.testing.assert_close(out[0], default[0])
        assert not torch.allclose(out[1], default[1], atol=1e-4)


def test_sequence_longer_than_rope_table_is_rejected() -> None:
    model = _built(_small_args(max_seq_len=8))
    with pytest.raises(ValueError, match="RoPE table"):
        model(torch.zeros(1, 9, dtype=torch.long))


PUBLISHED_PARAMS = {
    "1B": 1_235_814_400,
    "3B": 3_212_749_824,
    "8B": 8_030_261_248,
    "70B": 70_553_706_496,
    "405B": 405_853_388_800,
}


@pytest.mark.parametrize("flavor", sorted(PUBLISHED_PARAMS))
def test_published_parameter_counts(flavor: str) -> None:
    with torch.device("meta"):
        model = Transformer(LLAMA3_FLAVORS[flavor])
    assert count_params(model) == PUBLISHED_PARAMS[flavor]
    assert model.output.weight.is_meta


def test_published_ffn_widths() -> None:
    expected = {"1B": 8192, "3B": 8192, "8B": 14336, "70B": 28672, "405B": 53248}
    for flavor, hidden in expected.items():
        a = LLAMA3_FLAVORS[flavor]
        assert llama_ffn_hidden_dim(a.dim, a.multiple_of, a.ffn_dim_multiplier) == hidden


def _all_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    return tensors


@pytest.mark.parametrize("tied", [False, True])
def test_meta_init_matches_direct_init(tied: bool) -> None:
    args = _small_args(tie_word_embeddings=tied)
    direct = _built(args, seed=123)

    with torch.device("meta"):
        deferred = Transformer(args)
    deferred.to_empty(device="cpu")
    deferred.init_weights(seed=123)

    direct_tensors, deferred_tensors = _all_tensors(direct), _all_tensors(deferred)
    assert direct_tensors.keys() == deferred_tensors.keys()
    assert {"rope_cos", "rope_sin"} <= direct_tensors.keys()
    for name, tensor in direct_tensors.items():
        assert torch.equal(tensor, deferred_tensors[name]), name
    assert "rope_cos" not in direct.state_dict()

    other = _built(args, seed=124)
    assert not torch.equal(other.layers["0"].attention.wq.weight, direct.layers["0"].attention.wq.weight)
    assert not torch.equal(other.output.weight, direct.output.weight)


def test_tied_embeddings_share_storage() -> None:
    with torch.device("meta"):
        tied = Transformer(_small_args(tie_word_embeddings=True))
    tied.to_empty(device="cpu")
    tied.init_weights()
    assert tied.output.weight is tied.tok_embeddings.weight
    assert tied.output.weight.data_ptr() == tied.tok_embeddings.weight.data_ptr()
    # The shared matrix is initialised as an output projection, not with std 1.
    assert tied.output.weight.std().item() < 3 * tied.args.dim**-0.5
    tied.to(torch.bfloat16)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert tied.output.weight.dtype == torch.bfloat16
    assert tied.rope_cos.dtype == torch.float32
    torch.testing.assert_close(tied.rope_sin, _built(_small_args()).rope_sin, rtol=0, atol=0)
    assert tied(torch.zeros(1, 4, dtype=torch.long)).dtype == torch.float32

    untied = _built(_small_args())
    assert untied.output.weight.data_ptr() != untied.tok_embeddings.weight.data_ptr()
    assert abs(untied.tok_embeddings.weight.std().item() - 1.0) < 0.05


def test_init_statistics() -> None:
    model = _built(_small_args(n_layers=4))
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))
    for layer_id, layer in model.layers.items():
        out_std = 0.02 / math.sqrt(2 * (int(layer_id) + 1))
        for weight, std in (
            (layer.attention.wq.weight, 0.02),
            (layer.feed_forward.w1.weight, 0.02),
            (layer.attention.wo.weight, out_std),
            (layer.feed_forward.w2.weight, out_std),
            (layer.feed_forward.w3.weight, out_std),
        ):
            assert weight.abs().max().item() <= 3 * std + 1e-7
            assert abs(weight.std().item() / std - 1) < 0.2


def test_pipeline_stage_without_embeddings_and_head() -> None:
    model = _built(_small_args(n_layers=3))
    tokens = torch.randint(0, DEBUG.vocab_size, (1, 8))
    with torch.no_grad():
        full = model(tokens)
        first = _built(_small_args(n_layers=3))
        first.load_state_dict(model.state_dict())
        del first.layers["2"]
        first.norm = None
        first.output = None
        last = _built(_small_args(n_layers=3))
        last.load_state_dict(model.state_dict())
        del last.layers["0"], last.layers["1"]
        last.tok_embeddings = None
        hidden = first(tokens)
        assert hidden.shape == (1, 8, DEBUG.dim)
        torch.testing.assert_close(last(hidden), full)
    assert "layers.2.attention.wq.weight" in last.state_dict()


def test_rope_scaling_matches_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for factor, head_dim in ((8.0, 128), (32.0, 64)):
        scaling = RopeScaling(factor=factor)
        rope = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        if int(transformers.__version__.split(".")[0]) >= 5:
            rope_kwargs = {"rope_parameters": {**rope, "rope_theta": 500000.0}}
        else:
            rope_kwargs = {"rope_scaling": rope, "rope_theta": 500000.0}
        config = transformers.LlamaConfig(
            hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=131072, **rope_kwargs
        )
        expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
        ours = rope_inv_freq(head_dim, 500000.0, scaling)
        torch.testing.assert_close(ours.float(), expected.float(), rtol=1e-6, atol=1e-6)
        # Scaling must actually do something, or the comparison proves nothing.
        assert not torch.allclose(ours, rope_inv_freq(head_dim, 500000.0), rtol=1e-3)


def _reference_attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Meta-style complex RoPE, repeat_interleave'd KV heads and an explicit masked softmax."""
    bsz, seq_len, _ = x.shape
    head_dim = attn.head_dim
    q = attn.wq(x).view(bsz, seq_len, -1, head_dim)
    k = attn.wk(x).view(bsz, seq_len, -1, head_dim)
    v = attn.wv(x).view(bsz, seq_len, -1, head_dim)
    freqs_cis = torch.complex(cos[:seq_len], sin[:seq_len]).view(1, seq_len, 1, -1)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        pairs = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * freqs_cis).flatten(3)

    q, k = rotate(q), rotate(k)
    n_rep = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(n_rep, dim=2)
    v = v.repeat_interleave(n_rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(bsz, seq_len, -1)
    return attn.wo(out)


@pytest.mark.parametrize("n_heads,n_kv_heads", [(8, 2), (4, 4), (4, 1)])
def test_attention_matches_reference(n_heads: int, n_kv_heads: int) -> None:
    torch.manual_seed(0)
    head_dim = 16
    attn = Attention(64, n_heads, n_kv_heads, head_dim)
    attn.init_weights(0.05, 0.05)
    cos, sin = precompute_rope_tables(head_dim, 32, 10000.0, RopeScaling(original_max_position_embeddings=16))
    x = torch.randn(2, 10, 64)
    with torch.no_grad():
        expected = _reference_attention(attn, x, cos, sin)
        torch.testing.assert_close(attn(x, AttentionInputs(cos, sin)), expected, rtol=1e-5, atol=1e-5)


def test_rmsnorm_matches_definition_and_keeps_dtype() -> None:
    norm = RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 8)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected)
    assert norm(x.bfloat16()).dtype == torch.bfloat16
    norm.reset_parameters()
    assert torch.equal(norm.weight, torch.ones(8))


def test_flops_per_token_8b() -> None:
    args = LLAMA3_FLAVORS["8B"]
    flops = llama3_flops_per_token(args, 8192)
    assert abs(flops / 5.8e10 - 1) < 0.03
    n_nonembedding = PUBLISHED_PARAMS["8B"] - args.vocab_size * args.dim
    expected = decoder_flops_per_token(n_nonembedding, 32, 32, 128, 8192)
    assert flops == expected
    assert titanium.models.get_model_spec("llama3").flops_per_token is llama3_flops_per_token


def test_flops_counting_allocates_nothing() -> None:
    # A 405B model would need ~1.6 TB if the counting allocated real tensors.
    args = LLAMA3_FLAVORS["405B"]
    n = count_params_on_meta(Transformer, args, exclude_embedding=True)
    assert n == PUBLISHED_PARAMS["405B"] - args.vocab_size * args.dim


def test_tied_embedding_counted_once_as_output_projection() -> None:
    args = LLAMA3_FLAVORS["1B"]
    with torch.device("meta"):
        model = Transformer(args)
    # The shared matrix does a full matmul as the output projection, so it stays counted.
    assert count_params(model, exclude_embedding=True) == PUBLISHED_PARAMS["1B"]
    untied = dataclasses.replace(args, tie_word_embeddings=False)
    assert count_params_on_meta(Transformer, untied, exclude_embedding=True) == PUBLISHED_PARAMS["1B"]


FORBIDDEN_IMPORTS = ("torch.distributed", "titanium.parallel")


def _imported_modules(path: Path, package: str) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            names.append(module)
            names.extend(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_models_do_not_import_parallelism() -> None:
    models_dir = Path(titanium.models.__file__).parent
    root = models_dir.parent.parent
    offenders = []
    for path in sorted(models_dir.rglob("*.py")):
        if path.name == "parallelize.py":
            continue
        package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
        for name in _imported_modules(path, package):
            if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN_IMPORTS):
                offenders.append(f"{path.relative_to(root)}: {name}")
    assert not offenders, offenders
