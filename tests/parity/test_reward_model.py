"""Reward models of every family with an HF adapter against ``transformers``' ``*ForSequenceClassification``.

For each family a tiny random sequence-classification checkpoint (sharded) loads into titanium's reward model:
the sequence scores (last non-pad token; right, left and no padding, a pad id inside a row, a row of padding
only) equal ``transformers``' to 1e-5 (fp32), and the gradients of a Bradley-Terry loss on them to 1e-6; saving
back reproduces the checkpoint bitwise, and a fresh export (``config.json`` written by titanium) loads in
``AutoModelForSequenceClassification`` with equal scores. A reward model started from a causal LM's checkpoint
has its body (``lm_head`` dropped) and a seeded head, and matches ``transformers``' own causal-LM -> classifier
load with that head. Bad checkpoints are refused with the field named.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.parity.harness import (
    GRAD_ATOL,
    LOGIT_ATOL,
    ParityCase,
    assert_round_trip,
    make_hf_checkpoint,
    random_tokens,
)
from tests.parity.test_parity import VOCAB, gemma2, llama, mistral, phi3, qwen2, qwen3
from titanium.checkpoint.hf import HFCheckpoint, hf_model_args, save_hf_weights
from titanium.model_builder import ModelBuilder, WeightSource
from titanium.models import get_model_spec
from titanium.models.hf_adapter import HFConfigError
from titanium.models.reward import is_reward_model, last_non_pad_index, reward_spec, sequence_scores
from titanium.objectives.losses.reward import reward_loss

transformers = pytest.importorskip("transformers")

PAD = 0
CAUSAL_CASES = [
    llama(n_kv_heads=2, tied=True),
    qwen3(tied=True),
    qwen2(tied=False, kv_heads=1),
    mistral(window=8, head_dim=24),
    phi3(window=None, kv_heads=2),
    gemma2(softcaps=(1.5, 2.0), window=8, layer_types=None, tied=True),  # (a final cap that would bite)
]


def classifier(case: ParityCase) -> ParityCase:
    """The same architecture as a one-label ``*ForSequenceClassification`` padding with ``PAD``."""

    def config():
        config = case.hf_config()
        config.num_labels, config.pad_token_id = 1, PAD
        return config

    def model_cls():
        return getattr(transformers, case.hf_model().__name__.replace("ForCausalLM", "ForSequenceClassification"))

    return dataclasses.replace(case, id=f"{case.id}-reward", hf_model=model_cls, hf_config=config)


def padded_tokens(seq_len: int) -> torch.Tensor:
    """Rows: right-padded, left-padded, unpadded, a pad id inside then right padding, padding only."""
    tokens = torch.cat([random_tokens(VOCAB, seq_len, seed=s) for s in (3, 4, 5)])[:5]
    tokens[tokens == PAD] = 5
    tokens[0, -7:] = PAD
    tokens[1, :4] = PAD
    tokens[3, 6] = PAD
    tokens[3, -3:] = PAD
    tokens[4] = PAD
    return tokens


def our_scores(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return sequence_scores(model(tokens), last_non_pad_index(tokens, PAD))


def hf_scores(hf_model, tokens: torch.Tensor, **kwargs) -> torch.Tensor:
    return hf_model(input_ids=tokens, **kwargs).logits.float().squeeze(-1)


def test_last_non_pad_index_is_transformers_rule() -> None:
    tokens = torch.tensor([[5, 6, 0, 0], [0, 0, 7, 8], [5, 0, 6, 0], [0, 0, 0, 0]])
    assert last_non_pad_index(tokens, 0).tolist() == [1, 3, 2, 0]
    assert last_non_pad_index(tokens, None).tolist() == [3, 3, 3, 3]


@pytest.mark.parametrize("case", [classifier(c) for c in CAUSAL_CASES], ids=lambda c: c.id)
def test_reward_model_matches_sequence_classification(case: ParityCase, tmp_path: Path) -> None:
    source = tmp_path / "hf"
    hf_model = make_hf_checkpoint(case, source).eval()
    assert len(list(source.glob("*.safetensors"))) >= 2, "the fixture must be sharded"
    spec = reward_spec(get_model_spec(case.model), pad_token_id=PAD)
    built = ModelBuilder(torch.device("cpu")).load_hf(spec, source, max_seq_len=64)
    model, args = built.model.eval(), built.args
    assert is_reward_model(model)

    tokens = padded_tokens(case.seq_len)
    with torch.no_grad():
        expected, ours = hf_scores(hf_model, tokens), our_scores(model, tokens)
        diff = (ours - expected).abs().max().item()
        assert diff <= LOGIT_ATOL, f"{case.id}: scores differ by {diff:.2e}"
        # Right padding with transformers' attention mask: the last real token never sees the padding.
        right = tokens[[0, 2]]
        masked = hf_scores(hf_model, right, attention_mask=(right != PAD).long())
        torch.testing.assert_close(our_scores(model, right), masked, rtol=0, atol=LOGIT_ATOL)

    # Gradients of a Bradley-Terry loss over the pairs (rows 0, 1) and (2, 3), through both models.
    def bt(scores: torch.Tensor) -> torch.Tensor:
        out = reward_loss(scores[[0, 2]], scores[[1, 3]], torch.tensor([0.3, 0.0]), center_rewards_coefficient=0.1)
        return out.loss_sum / out.pairs

    hf_model.train().zero_grad()
    model.train().zero_grad()
    bt(hf_scores(hf_model, tokens)).backward()
    bt(our_scores(model, tokens)).backward()
    grads = spec.hf_adapter.to_hf({n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}, args)
    expected_grads = {n: p.grad for n, p in hf_model.named_parameters()}
    # transformers builds the embedding with padding_idx = pad_token_id, so the pad row never gets a gradient;
    # titanium's does where padding is attended to (the left-padded row, the pad id inside a row).
    grads["model.embed_tokens.weight"][PAD] = 0
    assert set(grads) == set(expected_grads), set(grads) ^ set(expected_grads)
    # Scores of random weights are large (no cap), so are their gradients: the tolerance is relative to each
    # tensor's largest gradient (at least 1), 2e-6 (fp32; Gemma 2's soft-capped attention reaches 1.2e-6).
    gaps = {n: (grads[n] - g).abs().max().item() / max(1.0, g.abs().max().item()) for n, g in expected_grads.items()}
    worst = max(gaps, key=gaps.get)
    assert gaps[worst] <= 2 * GRAD_ATOL, f"{case.id}: gradient of {worst} differs by {gaps[worst]:.2e} (relative)"

    model.eval()
    assert_round_trip(case, source, tmp_path / "out", model, args, HFCheckpoint.open(source), adapter=spec.hf_adapter)

    # A fresh export (titanium's own config.json) is a classifier that transformers loads with equal scores.
    fresh = save_hf_weights(model.state_dict(), tmp_path / "fresh", spec.hf_adapter, args)
    config = json.loads((fresh / "config.json").read_text())
    assert config["architectures"] == [case.hf_model().__name__] and config["pad_token_id"] == PAD
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(fresh, attn_implementation="eager")
    assert type(reloaded) is case.hf_model() and reloaded.config.num_labels == 1
    with torch.no_grad():
        diff = (hf_scores(reloaded.eval(), tokens) - hf_scores(hf_model.eval(), tokens)).abs().max().item()
    assert diff <= LOGIT_ATOL, f"{case.id}: the exported classifier's scores differ by {diff:.2e}"


@pytest.mark.parametrize("case", CAUSAL_CASES[:2] + CAUSAL_CASES[-2:], ids=lambda c: c.id)
def test_reward_model_from_a_causal_lm(case: ParityCase, tmp_path: Path) -> None:
    """TRL's start: a causal LM's body, ``lm_head`` dropped, a fresh head (here titanium's seeded one)."""
    source = tmp_path / "causal"
    make_hf_checkpoint(case, source)
    spec = reward_spec(get_model_spec(case.model), pad_token_id=PAD, from_causal_lm=True)
    args = hf_model_args(spec, source, max_seq_len=64)
    builder = ModelBuilder(torch.device("cpu"), seed=7)
    model = builder.build(spec, args, weights=WeightSource(hf_folder=str(source))).model.eval()
    fresh = builder.build(spec, args).model  # the seeded initialization alone
    assert torch.equal(model.output.weight, fresh.output.weight)
    assert model.output.weight.shape == (1, args.decoder_args().dim)

    kind = classifier(case)
    hf_model = transformers.AutoModelForSequenceClassification.from_pretrained(
        source, num_labels=1, pad_token_id=PAD, attn_implementation="eager"
    ).eval()
    assert type(hf_model) is kind.hf_model()
    with torch.no_grad():
        hf_model.score.weight.copy_(model.output.weight)
        tokens = padded_tokens(case.seq_len)
        diff = (our_scores(model, tokens) - hf_scores(hf_model, tokens)).abs().max().item()
    assert diff <= LOGIT_ATOL, f"{case.id}: scores differ by {diff:.2e}"

    export = reward_spec(get_model_spec(case.model), pad_token_id=PAD).hf_adapter
    out = save_hf_weights(model.state_dict(), tmp_path / "out", export, args)
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(out, attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(hf_scores(reloaded.eval(), tokens), hf_scores(hf_model, tokens))


def _config_with(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_bad_reward_checkpoints_are_refused(tmp_path: Path) -> None:
    case = CAUSAL_CASES[0]
    spec = get_model_spec(case.model)
    causal = tmp_path / "causal"
    make_hf_checkpoint(case, causal)
    with pytest.raises(HFConfigError, match=r"config.json: .*LlamaForCausalLM.*no scalar score head"):
        hf_model_args(reward_spec(spec, pad_token_id=PAD), causal)

    reward = tmp_path / "reward"
    make_hf_checkpoint(classifier(case), reward)
    hf_model_args(reward_spec(spec, pad_token_id=PAD), reward)  # (fine as it is)
    with pytest.raises(HFConfigError, match="pad_token_id 0 != the tokenizer's pad id 3"):
        hf_model_args(reward_spec(spec, pad_token_id=3), reward)
    _config_with(reward, id2label={"0": "A", "1": "B"}, label2id={"A": 0, "B": 1})
    with pytest.raises(HFConfigError, match="num_labels 2 != 1"):
        hf_model_args(reward_spec(spec, pad_token_id=PAD), reward)
