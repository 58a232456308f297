"""The families built on the shared decoder (qwen2, mistral, phi3, gemma2): published sizes, the registry and
--help, the config.json refusals, and Gemma 2's pieces on every path (flex and dense kernels, the chunked
cross-entropy, KV-cache decoding, the meta-device init).

Exactness against ``transformers`` is in tests/parity/test_parity.py; training, export and reload in
tests/e2e/test_families_train.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import tomllib
import torch
import torch.distributed as dist

from tests.helpers import REPO
from titanium.batch import Batch
from titanium.checkpoint.hf import hf_model_args
from titanium.config.reference import render_reference
from titanium.generation.generate import generate
from titanium.generation.sampling import SamplingParams
from titanium.models import get_model_spec, list_models
from titanium.models.common.decoder import Decoder, DecoderArgs
from titanium.models.flops import count_params_on_meta
from titanium.models.hf_adapter import HFConfigError
from titanium.objectives.base import ModelOutput
from titanium.objectives.losses.cross_entropy import TokenCrossEntropy, TokenFields, cross_entropy_sum
from titanium.tools.dry_run import dry_run

# Exact totals (a tied embedding counted once) and the size the Hugging Face hub shows for the published
# checkpoints: Qwen/Qwen2.5-*, mistralai/Mistral-7B-v0.3, mistralai/Mistral-Nemo-Base-2407,
# microsoft/Phi-3-mini-4k-instruct, microsoft/Phi-3-medium-4k-instruct, microsoft/phi-4, google/gemma-2-*.
PUBLISHED = {
    ("qwen2", "0.5B"): (494_032_768, "494M"),
    ("qwen2", "1.5B"): (1_543_714_304, "1.54B"),
    ("qwen2", "3B"): (3_085_938_688, "3.09B"),
    ("qwen2", "7B"): (7_615_616_512, "7.62B"),
    ("qwen2", "14B"): (14_770_033_664, "14.8B"),
    ("qwen2", "32B"): (32_763_876_352, "32.8B"),
    ("qwen2", "72B"): (72_706_203_648, "72.7B"),
    ("mistral", "7B"): (7_248_023_552, "7.25B"),
    ("mistral", "NeMo-12B"): (12_247_782_400, "12.2B"),
    ("phi3", "mini"): (3_821_079_552, "3.82B"),
    ("phi3", "medium"): (13_960_238_080, "14B"),
    ("phi3", "phi4-14B"): (14_659_507_200, "14.7B"),
    ("gemma2", "2B"): (2_614_341_888, "2.61B"),
    ("gemma2", "9B"): (9_241_705_984, "9.24B"),
    ("gemma2", "27B"): (27_227_128_320, "27.2B"),
}
NEW_FAMILIES = ("qwen2", "mistral", "phi3", "gemma2")


def _closed_form(a: DecoderArgs) -> int:
    """The count written out from the config.json fields, independent of the module code."""
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    attention = a.dim * q + 2 * a.dim * kv + q * a.dim + ((q + 2 * kv) if a.attention_bias else 0)
    per_layer = attention + 3 * a.dim * a.ffn_dim + (4 if a.post_norms else 2) * a.dim
    return a.n_layers * per_layer + a.dim + a.vocab_size * a.dim * (1 if a.tie_word_embeddings else 2)


def _hub_size(n: int) -> str:
    """The hub's rounding: three significant digits, trailing zeros dropped (14.0B -> 14B)."""
    value, unit = (n / 1e9, "B") if n >= 1e9 else (n / 1e6, "M")
    return f"{float(f'{value:.3g}'):g}{unit}"


@pytest.mark.parametrize("family,flavor", sorted(PUBLISHED))
def test_parameter_counts_match_published(family: str, flavor: str) -> None:
    args = get_model_spec(family).flavors[flavor]
    total, hub = PUBLISHED[(family, flavor)]
    assert count_params_on_meta(Decoder, args) == total == _closed_form(args)
    assert _hub_size(total) == hub


def test_every_family_and_flavor_is_registered_and_listed_in_help() -> None:
    """``--model.flavor``'s help (and so docs/configuration.md) names every flavor with its parameter count."""
    assert set(NEW_FAMILIES) <= set(list_models())
    help_text = " ".join(render_reference().split())  # (the field docstrings --help shows)
    for name in list_models():
        spec = get_model_spec(name)
        assert spec.hf_adapter is not None and spec.tp_plan is not None, name
        listed = ", ".join(
            f"{flavor} ({_hub_size(count_params_on_meta(spec.model_cls, args))})"
            for flavor, args in spec.flavors.items()
        )
        assert f"{name}: {listed}" in help_text, f"--model.flavor's docstring must list: {name}: {listed}"


# ----- config.json refusals (one message naming the field) -----


def _config_folder(tmp_path: Path, family: str, **changes) -> Path:
    spec = get_model_spec(family)
    config = spec.hf_adapter.to_hf_config(spec.flavors["debugmodel"])
    config.update(changes)
    folder = tmp_path / family
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not ...}))
    return folder


@pytest.mark.parametrize(
    "family,changes,message",
    [
        ("gemma2", {"attn_logit_softcapping": None}, "attn_logit_softcapping is missing or null: Gemma 2 caps its"),
        ("gemma2", {"final_logit_softcapping": ...}, "final_logit_softcapping is missing or null"),
        ("gemma2", {"query_pre_attn_scalar": ...}, "query_pre_attn_scalar is missing"),
        ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
        ("gemma2", {"layer_types": ["sliding_attention"] * 5 + ["chunked"]}, "layer_types ["),
        (
            "phi3",
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16}},
            "rope_scaling type 'longrope' (LongRoPE, the 128k-context Phi-3 variants) is not supported",
        ),
        ("phi3", {"partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75 is not supported"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window = true is not supported"),
        ("mistral", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling {'rope_type': 'yarn'"),
        ("mistral", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(tmp_path: Path, family, changes, message) -> None:
    folder = _config_folder(tmp_path, family, **changes)
    with pytest.raises(HFConfigError) as err:
        hf_model_args(get_model_spec(family), folder)
    assert str(err.value).startswith(f"{folder / 'config.json'}: ") and message in str(err.value), str(err.value)


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_config_json_round_trips_every_flavor(family: str) -> None:
    adapter = get_model_spec(family).hf_adapter
    for args in get_model_spec(family).flavors.values():
        assert adapter.from_hf_config(adapter.to_hf_config(args)) == args


def test_gemma2_layer_types_default_to_the_alternation() -> None:
    """A transformers 4 config.json has no layer_types: even layers slide, as Gemma 2 does."""
    adapter = get_model_spec("gemma2").hf_adapter
    config = adapter.to_hf_config(get_model_spec("gemma2").flavors["2B"])
    del config["layer_types"]
    assert adapter.from_hf_config(config).global_layers == tuple(range(1, 26, 2))


# ----- Gemma 2 on every path -----


def _gemma2(**changes) -> Decoder:
    """A small random Gemma 2 whose caps bite and whose window is shorter than the rows."""
    base = get_model_spec("gemma2").flavors["debugmodel"]
    args = dataclasses.replace(
        base, n_layers=2, vocab_size=300, max_seq_len=64, sliding_window=6, attn_logit_softcap=3.0,
        final_logit_softcap=4.0, **changes,
    )  # fmt: skip
    model = Decoder(args)
    model.init_weights(seed=0)
    with torch.no_grad():  # norm scales random too (the init's zeros would hide a wrong 1 + w)
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(-0.5, 0.5)
    return model.eval()


def _packed() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lengths = [[20, 12], [9, 23]]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    documents = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in lengths])
    tokens = torch.randint(0, 300, positions.shape, generator=torch.Generator().manual_seed(1))
    return tokens, positions, documents


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("documents", [False, True])
def test_gemma2_flex_and_dense_kernels_agree(documents: bool) -> None:
    """The CUDA kernel's forward (flex: soft-capping score_mod, windowed and global block masks) equals the exact
    dense path on CPU, for plain rows and packed documents."""
    model = _gemma2()
    tokens, positions, document_ids = _packed()
    inputs = {"positions": positions, "document_ids": document_ids} if documents else {}
    logits = {}
    for backend in ("sdpa", "flex"):
        model.attention_backend = backend
        with torch.no_grad():
            logits[backend] = model(tokens, **inputs)
    torch.testing.assert_close(logits["flex"], logits["sdpa"], rtol=1e-5, atol=1e-5)
    assert logits["sdpa"].abs().max() <= 4.0  # (the final cap)


def test_gemma2_chunked_cross_entropy_applies_the_final_cap() -> None:
    model = _gemma2()
    tokens, positions, documents = _packed()
    labels = tokens.roll(-1, 1)
    full = cross_entropy_sum(model(tokens), labels)
    expected = torch.autograd.grad(full, [model.output.weight, model.layers["0"].attention.wq.weight])
    chunked = TokenCrossEntropy(16)
    (batch,) = chunked.prepare([Batch(tokens, TokenFields(labels))])
    loss = chunked(ModelOutput(hidden=model(tokens, project=False), projection=model.output), batch)
    got = torch.autograd.grad(loss, [model.output.weight, model.layers["0"].attention.wq.weight])
    torch.testing.assert_close(loss, full, rtol=1e-5, atol=0)
    for a, b in zip(got, expected, strict=True):  # (sums in another order: 1e-6 of the largest entry)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())
    with torch.no_grad():  # (the cap mattered: the uncapped logits score otherwise)
        uncapped = cross_entropy_sum(model.output(model(tokens, project=False)).float(), labels)
    assert model.output.logit_softcap == 4.0 and not torch.allclose(uncapped, full, rtol=1e-3)


@torch.no_grad()
def test_gemma2_cached_decoding_equals_full_forwards() -> None:
    """KV-cache decoding with left padding (the windowed, soft-capped cache path) picks the tokens that re-running
    each row in full picks, greedily."""
    model = _gemma2()
    prompts = [[5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41], [3, 1, 4], [2, 7, 1, 8, 2, 8, 1]]
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    result = generate(model, prompts, params, set(), 0, generator=torch.Generator().manual_seed(0))
    for prompt, produced in zip(prompts, result.token_lists(), strict=True):
        seq = list(prompt)
        for _ in range(params.max_new_tokens):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        assert produced == seq[len(prompt) :]


def test_gemma2_meta_init_and_window_rules() -> None:
    args = get_model_spec("gemma2").flavors["debugmodel"]
    with torch.device("meta"):
        model = Decoder(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    block = model.layers["0"]
    for norm in (block.attention_norm, block.post_attention_norm, block.ffn_norm, block.post_ffn_norm, model.norm):
        assert norm.unit_offset and torch.equal(norm.weight, torch.zeros_like(norm.weight))  # 1 + w = 1
    assert model.output.weight is model.tok_embeddings.weight
    assert [model.layers[str(i)].attention.window for i in range(6)] == [512, None] * 3
    # A window as long as the rows hides nothing: those layers take the plain causal path.
    assert dataclasses.replace(args, max_seq_len=512).window(0) is None


# ----- shipped configs -----

CONFIGS = {  # each family's SFT and LoRA configs, Llama 3.2 / 3.3's SFT ones: the world size their header gives
    "qwen2_7b_sft": 8, "qwen2_7b_lora": 1, "mistral_7b_sft": 8, "mistral_7b_lora": 1, "phi3_mini_sft": 8,
    "phi3_mini_lora": 1, "phi4_14b_sft": 8, "gemma2_2b_sft": 8, "gemma2_9b_sft": 8, "gemma2_9b_lora": 1,
    "llama3_1b_sft": 8, "llama3_3b_sft": 8, "llama3_70b_sft": 64,
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_shipped_config_plans_from_the_published_config_json(name: str, tmp_path: Path, monkeypatch) -> None:
    """Each config's parallel plan builds (the dry run, on a fake process group) with the architecture read from
    a stand-in of the published checkpoint's config.json, as training would read it. The memory estimate of the
    tightest one (Gemma 2 9B, 8 GPUs) fits an 80 GB GPU; the others' were measured to fit (docs/models.md)."""
    monkeypatch.chdir(REPO)
    path = REPO / "train_configs" / f"{name}.toml"
    model = tomllib.loads(path.read_text())["model"]
    spec = get_model_spec(model["name"])
    (tmp_path / "config.json").write_text(json.dumps(spec.hf_adapter.to_hf_config(spec.flavors[model["flavor"]])))
    try:
        run = dry_run(["--job.config_file", str(path), "--checkpoint.initial_load_path", str(tmp_path)], CONFIGS[name])
        assert run.model is not None
        if name == "gemma2_9b_sft":
            assert run.estimate_memory().fits(78)
    finally:
        dist.destroy_process_group()
