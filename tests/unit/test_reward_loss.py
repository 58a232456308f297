"""The Bradley-Terry reward loss against TRL 1.16's own ``RewardTrainer.compute_loss`` on the same scores.

A real ``RewardTrainer`` is built around a tiny sequence-classification model; its ``compute_loss`` is then
handed a stand-in model whose output logits are the given scores (chosen rows first, as TRL's collator stacks
them), so TRL's own code computes the loss, the accuracy and the margin metric. Loss, metrics and gradients
w.r.t. the scores must equal titanium's ``reward_loss`` (sum / pairs) to 1e-6, with and without margins and
the centering term.
"""

from __future__ import annotations

import math
import tempfile
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from titanium.objectives.losses.reward import reward_loss

TOL = {"rtol": 1e-6, "atol": 1e-6}


def scores(seed: int, pairs: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    chosen, rejected = torch.randn(pairs, generator=g) * 2, torch.randn(pairs, generator=g) * 2
    rejected[0] = chosen[0]  # a tie: not counted as correct
    margin = torch.rand(pairs, generator=g) * 1.5
    return chosen, rejected, margin


def test_hand_values() -> None:
    chosen, rejected = torch.tensor([2.0, -1.0, 0.5]), torch.tensor([1.0, 1.0, 0.5])
    out = reward_loss(chosen, rejected, margin=torch.tensor([0.5, 0.0, 0.0]), center_rewards_coefficient=0.1)
    expected = (
        -math.log(1 / (1 + math.exp(-0.5)))
        + 0.1 * 9
        - math.log(1 / (1 + math.exp(2.0)))
        + 0.0
        - math.log(0.5)
        + 0.1 * 1.0
    )
    assert out.loss_sum.item() == pytest.approx(expected, rel=1e-6)
    assert out.pairs.item() == 3
    assert out.metrics["accuracy"].item() == 1.0  # the tie is not a win
    assert out.metrics["margin"].item() == pytest.approx(1.0 - 2.0 + 0.0)
    assert out.metrics["reward_chosen"].item() == pytest.approx(1.5)


def test_masked_slots_are_no_pairs() -> None:
    chosen, rejected, margin = scores(0)
    mask = torch.tensor([True, False, True, True, False, True])
    full = reward_loss(chosen[mask], rejected[mask], margin[mask], 0.05)
    masked = reward_loss(chosen, rejected, margin, 0.05, mask=mask)
    torch.testing.assert_close(masked.loss_sum, full.loss_sum, **TOL)
    assert masked.pairs.item() == 4
    for name, value in full.metrics.items():
        torch.testing.assert_close(masked.metrics[name], value, **TOL)


def test_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match="must be"):
        reward_loss(torch.zeros(3), torch.zeros(2))


def trl_trainer(center_rewards_coefficient: float | None) -> Any:
    """A real TRL RewardTrainer around a tiny random Llama classifier (its dataset is never trained on)."""
    pytest.importorskip("trl", reason="pip install 'trl>=1.16,<2' (in the dev extra) to compare with TRL")
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    from tests.objectives.tiny_hf import PAD, word_tokenizer

    config = LlamaConfig(
        vocab_size=48,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_labels=1,
        pad_token_id=PAD,
    )
    args = RewardConfig(
        output_dir=tempfile.mkdtemp(),
        report_to=[],
        use_cpu=True,
        bf16=False,
        center_rewards_coefficient=center_rewards_coefficient,
    )
    data = Dataset.from_dict({"chosen": ["t5 t6"], "rejected": ["t7"]})
    trainer = RewardTrainer(
        model=LlamaForSequenceClassification(config),
        args=args,
        train_dataset=data,
        processing_class=word_tokenizer(),
    )
    trainer.model.train()
    return trainer


def trl_loss(trainer: Any, chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None):
    """TRL's compute_loss on these scores: the stand-in model returns them as the classifier's logits."""
    logits = torch.cat([chosen, rejected]).unsqueeze(-1)
    inputs: dict[str, Any] = {"attention_mask": torch.ones(logits.shape[0], 3, dtype=torch.long)}
    if margin is not None:
        inputs["margin"] = margin
    trainer._metrics["train"].clear()
    loss = trainer.compute_loss(lambda **_: SimpleNamespace(logits=logits), inputs)
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return loss, metrics


@pytest.mark.parametrize("center", [None, 0.01, 0.3])
@pytest.mark.parametrize("with_margin", [False, True])
def test_matches_trl_reward_trainer(center: float | None, with_margin: bool) -> None:
    trainer = trl_trainer(center)
    for seed in (0, 1, 2):
        chosen, rejected, margin = scores(seed)
        margin_in = margin if with_margin else None
        theirs_c, theirs_r = chosen.clone().requires_grad_(), rejected.clone().requires_grad_()
        expected, metrics = trl_loss(trainer, theirs_c, theirs_r, margin_in)
        expected.backward()

        ours_c, ours_r = chosen.clone().requires_grad_(), rejected.clone().requires_grad_()
        out = reward_loss(ours_c, ours_r, margin_in, center)
        loss = out.loss_sum / out.pairs
        loss.backward()
        torch.testing.assert_close(loss, expected.detach(), **TOL)
        torch.testing.assert_close(ours_c.grad, theirs_c.grad, **TOL)
        torch.testing.assert_close(ours_r.grad, theirs_r.grad, **TOL)
        pairs = out.pairs.item()
        assert (out.metrics["accuracy"] / pairs).item() == pytest.approx(metrics["accuracy"], abs=1e-6)
        assert (out.metrics["margin"] / pairs).item() == pytest.approx(metrics["margin"], abs=1e-6)
        mean_reward = (out.metrics["reward_chosen"] + out.metrics["reward_rejected"]) / (2 * pairs)
        assert mean_reward.item() == pytest.approx(metrics["mean_reward"], abs=1e-6)
