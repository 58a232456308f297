"""Any Hugging Face model of a supported family trains: the shape comes from its config.json, never a flavor.

Three random shapes per family (each family's own features drawn too: sliding windows, soft-capping caps,
Gemma 2's layer order), each made and saved by ``transformers`` (every weight random), are trained for
two steps by titanium from the folder (``--model.flavor`` left at ``debugmodel``, which none of them is),
exported with ``last_save_in_hf`` and reloaded by ``transformers``: its logits equal those of titanium's trained
model to 1e-5 (fp32). The dry run and ``tools.eval_preference`` take the same shape from the same file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import REPO, tiny_args
from tests.parity.harness import randomize_
from titanium.tools import eval_preference
from titanium.tools.dry_run import dry_run

transformers = pytest.importorskip("transformers")

TOKENIZER_VOCAB = 2256  # assets/tokenizer/titanium_debug.tiktoken (the debug config's tokenizer)
HF_CLASSES = {
    "llama3": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
}
HEAD_DIM_IS_WIDTH_OVER_HEADS = ("llama3", "qwen2", "phi3")


def _rope(theta: float) -> dict:
    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    return {"rope_theta": theta}


def random_config(family: str, seed: int):
    """A small random shape of ``family`` that no flavor has (heads, KV heads, widths, depth, tying, RoPE, eps)."""
    rng = random.Random(f"{family}-{seed}")
    heads = rng.choice([2, 4, 6])
    kv_heads = rng.choice([d for d in range(1, heads + 1) if heads % d == 0])
    head_dim = rng.choice([8, 16])
    fields = dict(
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=heads * (head_dim if family in HEAD_DIM_IS_WIDTH_OVER_HEADS else rng.choice([6, 12, 20])),
        intermediate_size=rng.randrange(40, 200, 8),
        num_hidden_layers=rng.randint(1, 3),
        vocab_size=TOKENIZER_VOCAB + rng.randrange(0, 64),  # the embedding may have spare rows
        tie_word_embeddings=rng.random() < 0.5,
        rms_norm_eps=rng.choice([1e-5, 1e-6]),
        max_position_embeddings=rng.choice([2048, 4096]),
        **_rope(rng.choice([10_000.0, 500_000.0, 1_000_000.0])),
    )
    if family in ("mistral", "phi3"):
        fields.update(sliding_window=rng.choice([None, 8, 20]), pad_token_id=0)
    if family == "gemma2":
        fields.update(
            sliding_window=rng.choice([8, 20]),
            layer_types=[
                rng.choice(["sliding_attention", "full_attention"]) for _ in range(fields["num_hidden_layers"])
            ],
            query_pre_attn_scalar=rng.choice([16, 24, 32]),
            attn_logit_softcapping=rng.choice([5.0, 50.0]),
            final_logit_softcapping=rng.choice([3.0, 30.0]),
            attn_implementation="eager",  # (transformers' only soft-capping attention)
        )
    return getattr(transformers, HF_CLASSES[family]).config_class(**fields)


def make_checkpoint(folder: Path, family: str, seed: int):
    hf_cls = getattr(transformers, HF_CLASSES[family])
    model = hf_cls(random_config(family, seed)).float().eval()
    randomize_(model, seed)
    model.save_pretrained(folder, max_shard_size="200KB")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
    return model


CASES = [(family, seed) for family in HF_CLASSES for seed in range(3)]


@pytest.mark.parametrize("family,seed", CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_random_shape_trains_exports_and_reloads(make_trainer, tmp_path: Path, family: str, seed: int) -> None:
    source = tmp_path / "hf_source"
    hf_model = make_checkpoint(source, family, seed)
    config = hf_model.config
    trainer = make_trainer(
        *tiny_args(tmp_path / "run", "--model.name", family, "--training.steps", "2"),
        "--checkpoint.initial_load_path", str(source), "--checkpoint.initial_load_in_hf",
        "--checkpoint.last_save_in_hf",
    )  # fmt: skip
    args = trainer.model_args.decoder_args()
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim, args.ffn_dim) == (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.intermediate_size,
    )
    assert (args.vocab_size, args.tie_word_embeddings) == (config.vocab_size, config.tie_word_embeddings)
    tokens = torch.randint(0, TOKENIZER_VOCAB, (2, 32), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        assert (trainer.model(tokens) - hf_model(input_ids=tokens).logits).abs().max() <= 1e-5

    trainer.train()
    hf_cls = getattr(transformers, HF_CLASSES[family])
    reloaded = hf_cls.from_pretrained(tmp_path / "run/hf", attn_implementation="eager").eval()
    with torch.no_grad():
        ours = trainer.model.eval()(tokens)
        assert (ours - hf_model(input_ids=tokens).logits).abs().max() > 1e-3, "training changed nothing"
        diff = (reloaded(input_ids=tokens).logits - ours).abs().max().item()
    assert diff <= 1e-5, f"transformers' reload of the export differs from titanium's model by {diff:.2e}"


def test_dry_run_and_eval_preference_read_the_shape(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(REPO)
    source = tmp_path / "hf_source"
    config = make_checkpoint(source, "qwen3", 0).config
    start = ["--model.name", "qwen3", "--checkpoint.initial_load_path", str(source), "--checkpoint.initial_load_in_hf"]
    try:
        run = dry_run(["--job.config_file", "train_configs/debug_model.toml", *start], world_size=2)
        params = {p.name: p for p in run.params}
        assert params["tok_embeddings.weight"].global_shape == (config.vocab_size, config.hidden_size)
        assert len({name.split(".")[1] for name in params if name.startswith("layers.")}) == config.num_hidden_layers
        assert run.estimate_memory().fits(78)
    finally:
        dist.destroy_process_group()

    code = eval_preference.main([
        str(source), str(source), "--data", "assets/tasks/arithmetic/preference_test.jsonl", "--max-pairs", "8",
        "--job.config_file", "train_configs/debug_dpo.toml", "--model.name", "qwen3", "--device", "cpu",
        "--checkpoint.initial_load_path", str(tmp_path),  # (the job's start; the folders above give the shape)
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["pairs"] == 8 and result["reward_accuracy"] == 0.0  # the policy is its reference


def test_other_family_or_unsupported_feature_fails_before_training(tmp_path: Path, capsys, monkeypatch) -> None:
    from titanium.train import main

    monkeypatch.chdir(REPO)
    source = tmp_path / "qwen"
    make_checkpoint(source, "qwen3", 1)
    start = ["--checkpoint.initial_load_path", str(source), "--checkpoint.initial_load_in_hf"]
    code = main(tiny_args(tmp_path / "run", "--model.name", "llama3", *start))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert (
        f"titanium: config error: --model.name llama3 disagrees with {source / 'config.json'} (model_type 'qwen3': "
        "titanium's qwen3); leave --model.name out (the folder says it)"
    ) in err

    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "use_sliding_window": True, "sliding_window": 16}))
    code = main(tiny_args(tmp_path / "run", "--model.name", "qwen3", *start))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"error: --checkpoint.initial_load_path: {source / 'config.json'}: use_sliding_window = true is not" in err
    assert not (tmp_path / "run/hf").exists()


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [4.0] * 16, "factor": 32.0}


@pytest.mark.parametrize(
    "family,changes,message",
    [
        (
            "gemma2",
            {"attn_logit_softcapping": None},
            "attn_logit_softcapping is missing or null: Gemma 2 caps its attention logits (50.0 in the published "
            "checkpoints); state it in config.json",
        ),
        (
            "phi3",
            {"rope_scaling": LONGROPE, "max_position_embeddings": 131072},
            "rope_scaling type 'longrope' (LongRoPE, the 128k-context Phi-3 variants) is not supported; use a "
            "4k-context variant",
        ),
    ],
)
def test_unsupported_feature_exits_2_naming_the_field(tmp_path: Path, capsys, monkeypatch, family, changes, message):
    """A checkpoint of a family with a feature titanium does not implement: one line naming the file and the
    field, exit code 2, before any weight is read (the folder has no weights at all)."""
    from titanium.models import get_model_spec
    from titanium.train import main

    monkeypatch.chdir(REPO)
    spec = get_model_spec(family)
    source = tmp_path / "source"
    source.mkdir()
    config = {**spec.hf_adapter.to_hf_config(spec.flavors["debugmodel"]), **changes}
    (source / "config.json").write_text(json.dumps(config))
    start = ["--checkpoint.initial_load_path", str(source), "--checkpoint.initial_load_in_hf"]
    code = main(tiny_args(tmp_path / "run", "--model.name", family, *start))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert f"titanium: error: --checkpoint.initial_load_path: {source / 'config.json'}: {message}\n" in err, err
