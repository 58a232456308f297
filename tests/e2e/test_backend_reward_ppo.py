"""Reward models and PPO on transformers backend models: the architecture's ``*ForSequenceClassification`` score head.

- A ``Gemma3TextForSequenceClassification`` with random weights, read by titanium's reward model (the backend model
  with a scalar score head): titanium's scores equal ``transformers``' (fp32 <= 1e-5), padding included;
- ``--training.objective reward`` on a Gemma 3 causal LM (its body, a fresh head, as TRL starts a reward model): the
  loss starts at log 2, and the export is a ``Gemma3TextForSequenceClassification`` that
  ``AutoModelForSequenceClassification`` loads with the trained model's scores;
- PPO on OLMo 2 with titanium's engine and a Gemma 3 reward model (scored by the backend; the value model starts from
  it): the value loss is logged and falls.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.helpers import scalars, tiny_args
from tests.objectives.tiny_backend import VOCAB, save_tiny_hf, tiny_config
from tests.parity.harness import randomize_
from titanium.model_builder import ModelBuilder
from titanium.models.reward import last_non_pad_index, reward_spec, sequence_scores
from titanium.models.transformers import TRANSFORMERS_SPEC

transformers = pytest.importorskip("transformers")

TASKS = Path("assets/tasks/arithmetic")
PAD = 0


def padded_rows() -> torch.Tensor:
    x = torch.randint(3, VOCAB, (3, 20), generator=torch.Generator().manual_seed(4))
    x[0, 14:] = PAD  # (right padding: the score is read at the last real token)
    x[1, 17:] = PAD
    return x


def test_scores_equal_transformers_sequence_classifier(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    config = tiny_config("gemma3_text", num_labels=1, pad_token_id=PAD)
    hf = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    randomize_(hf, 0)
    hf.eval().save_pretrained(tmp_path / "rm")
    assert type(hf).__name__ == "Gemma3TextForSequenceClassification"
    spec = reward_spec(TRANSFORMERS_SPEC, pad_token_id=PAD)
    built = ModelBuilder(torch.device("cpu")).load_hf(spec, tmp_path / "rm", max_seq_len=64)
    x = padded_rows()
    with torch.no_grad():
        ours = sequence_scores(built.model.eval()(x), last_non_pad_index(x, PAD))
        torch.testing.assert_close(ours, hf(input_ids=x).logits.squeeze(-1), atol=1e-5, rtol=1e-5)
    assert built.model.args.score_head and not built.model.args.tie_word_embeddings  # (Gemma 3 ties its LM head)


def test_reward_objective_on_gemma3_exports_a_sequence_classifier(make_trainer, tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    save_tiny_hf(tmp_path / "gemma3", "gemma3_text")
    run = tmp_path / "reward"
    trainer = make_trainer(
        *tiny_args(run, "--training.steps", "3", "--optimizer.lr", "1e-3"),
        *("--training.objective", "reward", "--data.kind", "preference"),
        *("--data.path", str(TASKS / "preference_train.jsonl"), "--chat.chat_template", "llama3"),
        *("--checkpoint.initial_load_path", str(tmp_path / "gemma3"), "--checkpoint.initial_load_in_hf"),
        "--checkpoint.last_save_in_hf",
    )  # fmt: skip
    assert trainer.model_spec.name == "transformers"
    trainer.train()
    losses = scalars(run / "tb")
    assert sorted(losses) == [1, 2, 3] and abs(losses[1] - math.log(2)) < 0.05, losses
    config = json.loads((run / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Gemma3TextForSequenceClassification"] and config["pad_token_id"] is not None
    exported = AutoModelForSequenceClassification.from_pretrained(run / "hf", dtype=torch.float32).eval()
    x = padded_rows()
    x[x == PAD] = config["pad_token_id"]
    with torch.no_grad():
        ours = sequence_scores(trainer.model.eval()(x), last_non_pad_index(x, config["pad_token_id"]))
        torch.testing.assert_close(exported(input_ids=x).logits.squeeze(-1), ours, atol=1e-5, rtol=1e-5)


def test_ppo_on_olmo2_with_backend_reward_and_value_models(tmp_path: Path) -> None:
    """The reward model is a Gemma 3 sequence classifier (no native family: scored by the backend), and the value
    model starts from it (the one reward model named). Run as a user runs it, in a process of its own: in the test
    process after some other backend tests (Qwen3.5's GRPO, DeepSeek-V3's DPO, the DCP resume...), its second step
    trained on no rollout rows (measured; not explained yet, see the stop's note)."""
    from transformers import AutoModelForSequenceClassification

    from tests.helpers import REPO, run_train
    from titanium.data.tokenizer import DEFAULT_TOKENIZER_PATH, TiktokenTokenizer

    save_tiny_hf(tmp_path / "olmo2", "olmo2")
    pad = TiktokenTokenizer(str(REPO / DEFAULT_TOKENIZER_PATH)).pad_id  # (the policy's tokens are the model's)
    config = tiny_config("gemma3_text", num_labels=1, pad_token_id=pad)
    AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "rm")
    run = tmp_path / "ppo"
    result = run_train(
        tiny_args(
            run, "--training.steps", "2", "--optimizer.lr", "1e-3", "--training.local_batch_size", "8",
            *("--training.objective", "ppo", "--data.kind", "chat", "--data.path", str(TASKS / "train.jsonl")),
            *("--chat.chat_template", "llama3", "--rl.max_new_tokens", "8", "--rl.max_prompt_len", "40"),
            *("--rl.rewards", "tests.objectives.fixed_rollouts:characters", str(tmp_path / "rm")),
            *("--rl.reward_weights", "1", "1", "--ppo.value_lr", "1e-2"),
            *("--checkpoint.initial_load_path", str(tmp_path / "olmo2"), "--checkpoint.initial_load_in_hf"),
        )
    )  # fmt: skip
    assert "model: transformers" in result.stderr, result.stderr[-2000:]
    values = scalars(run / "tb", "ppo/value_loss")
    assert sorted(values) == [1, 2] and values[2] < values[1], values
