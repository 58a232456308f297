"""The reward objective end to end on CPU: train on the bundled preference pairs, export, load with transformers.

A causal LM (the debug model at its seeded initialization, saved in HF format) is the start: the reward model
takes its body and a fresh score head, as TRL's reward models start. ``train_configs/debug_reward.toml`` then trains
it for a few steps at a raised learning rate on the bundled pairs and exports an HF sequence-classification
checkpoint. Checked:

- the training loss falls from log 2 (scores start nearly equal) and the held-out validation loss ends below log 2;
- ``transformers.AutoModelForSequenceClassification`` loads the export (``LlamaForSequenceClassification``,
  ``num_labels = 1``) and scores held-out pairs as titanium's trained model does (the DCP checkpoint of the same
  step, built by the ModelBuilder), within 1e-5;
- the held-out pair accuracy the run logged (``validation/reward/accuracy``, the 32 pairs of the validation) is
  the share of those pairs the exported scores rank right, and above the starting model's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, run_train, scalars
from titanium.checkpoint.hf import export_hf
from titanium.config.sections import DataSection
from titanium.data.chat import build_chat_template
from titanium.data.preference import PreferenceDataset
from titanium.data.preference_batch import PreferenceBatchLoader
from titanium.data.tokenizer import TiktokenTokenizer
from titanium.model_builder import ModelBuilder, WeightSource
from titanium.models import build_model_args, get_model_spec
from titanium.models.reward import sequence_scores
from titanium.objectives.losses.reward import reward_loss
from titanium.objectives.reward import RewardObjective, whole_sequences

STEPS = 12
SEQ_LEN = 64
CENTERING = 0.01
HELD_OUT = "assets/tasks/arithmetic/preference_test.jsonl"


def held_out_rows(tokenizer, pairs: int) -> dict[str, torch.Tensor]:
    data = DataSection(kind="preference", path=str(REPO / HELD_OUT))
    template = build_chat_template("llama3", tokenizer, "llama3")
    dataset = PreferenceDataset(data, template, SEQ_LEN - 1, tokenizer.bos_id, None, "truncate", 0, 1)
    return next(PreferenceBatchLoader(dataset, pairs, SEQ_LEN, tokenizer.pad_id, False))


def scores(model: torch.nn.Module, batch) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return sequence_scores(model(batch.tokens), batch.fields.index)


def pair_loss(s: torch.Tensor) -> float:
    """The mean loss of the debug config (centering 0.01) over the pairs of scores ``s`` (rows 2g, 2g + 1)."""
    out = reward_loss(s[0::2], s[1::2], center_rewards_coefficient=CENTERING)
    return (out.loss_sum / out.pairs).item()


def test_reward_model_trains_and_exports_for_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    spec = get_model_spec("llama3")
    args = build_model_args(spec, "debugmodel", max_seq_len=SEQ_LEN)
    start = ModelBuilder(torch.device("cpu"), seed=0).build(spec, args)
    export_hf(start.model, tmp_path / "causal_lm", spec.hf_adapter, args)
    out = tmp_path / "run"
    run_train([
        "--job.config_file", str(REPO / "train_configs/debug_reward.toml"), "--job.dump_folder", str(out),
        "--job.no_print_config", "--training.steps", str(STEPS), "--training.local_batch_size", "8",
        "--training.mixed_precision_param", "float32", "--optimizer.lr", "5e-4", "--lr_scheduler.warmup_steps", "2",
        "--metrics.log_freq", "1", "--validation.interval", str(STEPS), "--validation.steps", "4",
        "--checkpoint.interval", str(STEPS), "--checkpoint.initial_load_path", str(tmp_path / "causal_lm"),
        "--checkpoint.initial_load_in_hf",
    ], timeout=600)  # fmt: skip

    losses = scalars(out / "tb")
    validation = scalars(out / "tb", "validation/loss")[STEPS]
    validation_accuracy = scalars(out / "tb", "validation/reward/accuracy")[STEPS]
    assert losses[1] == pytest.approx(math.log(2), abs=0.02)  # (+ the centering term of nearly equal scores)
    config = json.loads((out / "hf/config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["id2label"] == {"0": "LABEL_0"}
    tokenizer = TiktokenTokenizer(str(REPO / "assets/tokenizer/titanium_debug.tiktoken"))
    batch = whole_sequences(held_out_rows(tokenizer, 32), tokenizer.pad_id)
    reward = RewardObjective.policy_spec(spec, tokenizer, None)
    builder = ModelBuilder(torch.device("cpu"), seed=0)
    trained = builder.build(reward, args, weights=WeightSource(dcp_folder=str(out / f"checkpoint/step-{STEPS}")))
    initial = RewardObjective.policy_spec(spec, tokenizer, str(tmp_path / "causal_lm"))
    started = builder.build(initial, args, weights=WeightSource(hf_folder=str(tmp_path / "causal_lm")))
    ours, before = scores(trained.model, batch), scores(started.model, batch)
    with torch.no_grad():
        hf_model = transformers.AutoModelForSequenceClassification.from_pretrained(out / "hf").eval()
        theirs = hf_model(input_ids=batch.tokens).logits.squeeze(-1)
    assert (ours - theirs).abs().max().item() <= 1e-5, (ours, theirs)

    # The held-out loss the run logged is the trained model's on these pairs, and below the starting model's.
    held_out = {name: pair_loss(s) for name, s in (("before", before), ("after", ours))}
    accuracy = {name: (s[0::2] > s[1::2]).float().mean().item() for name, s in (("before", before), ("after", ours))}
    print(json.dumps({"losses": losses, "validation_loss": validation, "held_out": held_out, "accuracy": accuracy}))
    assert validation == pytest.approx(held_out["after"], rel=1e-4)
    assert held_out["after"] < held_out["before"] - 0.005, held_out
    assert validation_accuracy == pytest.approx(accuracy["after"], abs=1e-6)  # (a count of 32 pairs: exact)
    assert accuracy["after"] > accuracy["before"], accuracy
