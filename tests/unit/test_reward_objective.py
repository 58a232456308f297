"""The reward objective's batch (whole sequences, the score's position) and its config checks."""

from __future__ import annotations

import pytest
import torch

from titanium.batch import Placement
from titanium.config import load_config
from titanium.config.loader import ConfigError
from titanium.models.reward import sequence_scores
from titanium.objectives.base import IGNORE_INDEX
from titanium.objectives.reward import held_scores, starts_from_causal_lm, whole_sequences
from titanium.parallel.context import headtail_indices

PAD = 0


def test_whole_sequences_append_the_last_label_and_score_it():
    # Two rows as make_row shifts them: inputs t[:-1], labels t[1:] (prompt labels ignored), then padding.
    rows = {
        "input": torch.tensor([[5, 6, 7, PAD, PAD], [5, 8, PAD, PAD, PAD]]),
        "label": torch.tensor(
            [[IGNORE_INDEX, 7, 9, IGNORE_INDEX, IGNORE_INDEX], [IGNORE_INDEX, 4, *[IGNORE_INDEX] * 3]]
        ),
        "pairs_per_row": torch.tensor([1, 0]),
    }
    batch = whole_sequences(rows, PAD)
    assert batch.tokens.tolist() == [[5, 6, 7, 9, PAD], [5, 8, 4, PAD, PAD]]
    assert batch.fields.index.tolist() == [3, 2]
    assert batch.positions is None and batch.document_ids is None  # plain causal attention, as transformers
    assert batch.units().item() == 1
    assert rows["input"][0, 3] == PAD  # (the loader's rows are not changed)


def test_each_score_comes_from_the_context_parallel_part_that_holds_its_position():
    """Scores read from every cp rank's head-tail part of the rows, each part's zero where it lacks the position,
    add up to the scores of the whole rows (the sum ``add_parts`` completes over the cp group)."""
    rows = {
        "input": torch.tensor([[5, 6, 7, 8, 9, 3, PAD, PAD], [5, 8, *[PAD] * 6]]),
        "label": torch.tensor(
            [[IGNORE_INDEX, *[1] * 5, IGNORE_INDEX, IGNORE_INDEX], [IGNORE_INDEX, 4, *[IGNORE_INDEX] * 6]]
        ),
        "pairs_per_row": torch.tensor([1, 0]),
    }
    batch = whole_sequences(rows, PAD)
    scores = torch.randn(2, 8, 1)
    whole = held_scores(scores, batch, Placement())
    assert torch.equal(whole, sequence_scores(scores, batch.fields.index))
    for cp in (2, 4):
        parts = [headtail_indices(8, cp, rank) for rank in range(cp)]
        held = [held_scores(scores[:, index], batch.split_sequence(index), Placement()) for index in parts]
        assert torch.equal(sum(held), whole)
        assert sum(bool(h[0]) for h in held) == 1  # one part holds row 0's position


def test_context_parallelism_is_accepted():
    load_config([*REWARD, "--parallelism.context_parallel_degree", "2"])


def test_an_empty_slot_stays_padding():
    rows = {
        "input": torch.tensor([[PAD, PAD, PAD]]),
        "label": torch.full((1, 3), IGNORE_INDEX),
        "pairs_per_row": torch.tensor([0]),
    }
    assert whole_sequences(rows, PAD).tokens.tolist() == [[PAD, PAD, PAD]]


def test_the_start_folder_says_whether_the_head_is_fresh(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    assert starts_from_causal_lm(str(tmp_path))
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForSequenceClassification"]}')
    assert not starts_from_causal_lm(str(tmp_path))
    assert not starts_from_causal_lm(None)


REWARD = ["--training.objective", "reward", "--data.kind", "preference"]


@pytest.mark.parametrize(
    "args, message",
    [
        ([*REWARD, "--reward.center_rewards_coefficient", "-1"], "--reward.center_rewards_coefficient must be >= 0"),
        (
            ["--training.objective", "reward", "--data.kind", "text"],
            "--training.objective reward needs preference pairs",
        ),
    ],
)
def test_bad_reward_configs_are_refused(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config(args)
