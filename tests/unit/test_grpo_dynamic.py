"""DAPO's dynamic sampling and overlong shaping: the definitions against TRL's on fixed inputs, the rollout
assembly across rounds against one generation of the same rows, and the GRPO objective's batches: never a
zero-advantage group trained while rounds are left, always full, rounds counted."""

from __future__ import annotations

import pytest
import torch
from trl.rewards import get_soft_overlong_punishment
from trl.trainer.utils import nanstd

from tests.helpers import REPO
from tests.unit.test_grpo_objective import GROUP, _means, _model, _objective
from titanium.data.tokenizer import DEFAULT_TOKENIZER_PATH, TiktokenTokenizer
from titanium.generation.generate import Generation
from titanium.objectives.base import ModelOutput
from titanium.rl.dynamic import concat_rollouts, take_rows, zero_std_groups
from titanium.rl.rewards.functions import RewardSet, SoftOverlongPunishment
from titanium.rl.rollout import Rollout, to_rollout


@pytest.mark.parametrize("max_len, buffer", [(16, 4), (16, 16), (10, 1), (256, 64)])
def test_overlong_punishment_equals_trl(max_len: int, buffer: int) -> None:
    ids = [[7] * n for n in range(max_len + 4)]
    expected = get_soft_overlong_punishment(max_completion_len=max_len, soft_punish_cache=buffer)(ids)
    ours = SoftOverlongPunishment(max_len, buffer)(["x"] * len(ids), completion_ids=ids)
    assert ours == expected  # exactly: the same arithmetic


def test_zero_std_groups_equal_trls_is_std_zero() -> None:
    """TRL's ``frac_reward_zero_std`` test, ``isclose(nanstd(group), 0)``, on groups of 4: equal, spread, equal up
    to float rounding, a 1e-9 spread (TRL: zero), a single outlier."""
    rewards = torch.tensor(
        [
            [1.0, 1.0, 1.0, 1.0],
            [0.0, 0.0, 0.0, 1.0],
            [0.1 + 0.2, 0.3, 0.3, 0.3],
            [0.5, 0.5 + 1e-9, 0.5, 0.5],
            [-2.0, -2.0, -2.0, -2.0],
            [0.25, 0.5, 0.75, 1.0],
            [3.0, 3.0, 3.0 + 1e-6, 3.0],
        ],
        dtype=torch.float32,
    )
    std = nanstd(rewards, dim=1)
    expected = torch.isclose(std, torch.zeros_like(std))
    assert torch.equal(zero_std_groups(rewards.flatten(), 4), expected)
    assert expected.tolist() == [True, False, True, True, True, False, False]


@pytest.fixture(scope="module")
def tokenizer() -> TiktokenTokenizer:
    return TiktokenTokenizer(str(REPO / DEFAULT_TOKENIZER_PATH))


def _generation(tokenizer, responses: list[list[int]], finished: list[bool], width: int = 0) -> Generation:
    """Generation's output for ``responses`` (``width`` steps, at least the longest): log-probs made up from the
    ids, padding and 0 after each row's end."""
    width = max(width, *(len(r) for r in responses))
    tokens = torch.tensor([r + [tokenizer.pad_id] * (width - len(r)) for r in responses])
    lengths = torch.tensor([len(r) for r in responses])
    inside = torch.arange(width)[None, :] < lengths[:, None]
    return Generation(tokens, -0.01 * tokens.float() * inside, lengths, torch.tensor(finished))


def test_rollouts_of_several_rounds_join_as_one_generation_would_make_them(tokenizer) -> None:
    """Two rounds with other prompt and response widths, joined: every field equals ``to_rollout`` over the same
    rows generated at once (generation pads a row that ended early exactly as the join does)."""
    objective = _objective(tokenizer, _model(tokenizer.vocab_size))
    first, second = objective.source._next_prompts(2), objective.source._next_prompts(1)
    long_responses = [[5, 6, 7, 8, 9, 10][: 1 + i % 6] for i in range(2 * GROUP)]
    short_responses = [[11, 12][: 1 + i % 2] for i in range(GROUP)]
    finished = [True] * (2 * GROUP) + [i % 2 == 0 for i in range(GROUP)]
    gen_a = _generation(tokenizer, long_responses, finished[: 2 * GROUP])
    gen_b = _generation(tokenizer, short_responses, finished[2 * GROUP :])
    rewards = RewardSet(["exact_match"])
    a = to_rollout(first, GROUP, gen_a, rewards, tokenizer)
    b = to_rollout(second, GROUP, gen_b, rewards, tokenizer)
    assert a.prompt_width != b.prompt_width and a.response_mask.shape != b.response_mask.shape

    both = _generation(tokenizer, long_responses + short_responses, finished)
    expected = to_rollout(first + second, GROUP, both, rewards, tokenizer)
    joined = concat_rollouts([a, b], tokenizer.pad_id)
    _assert_same(joined, expected)
    picked = take_rows(joined, [8, 9, 10, 11, 0, 1, 2, 3])
    _assert_same(picked, take_rows(expected, [8, 9, 10, 11, 0, 1, 2, 3]))
    assert picked.completions == expected.completions[8:] + expected.completions[:4]


def _assert_same(got: Rollout, expected: Rollout) -> None:
    assert got.prompt_width == expected.prompt_width and got.completions == expected.completions
    for name in ("tokens", "positions", "document_ids", "response_mask", "finished", "old_logprobs"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert torch.equal(got.rewards.total, expected.rewards.total)


EQUAL_GROUPS = {0: {0, 2}, 1: {0, 1, 2, 3}, 2: {1}}
"""Per generation round (the objective's ``index``): which of its 4 groups get equal responses (equal rewards)."""


def _scripted_sample(objective, tokenizer, made: list[tuple[int, int]]):
    """A ``sample`` that answers each group of round ``index`` with 4 equal responses or 4 of different lengths
    (``EQUAL_GROUPS``), and notes (round, group) of every group it makes."""
    eot = tokenizer.special_tokens["<|eot_id|>"]
    digit = tokenizer.encode("7", bos=False, eos=False)

    def sample(samples, index) -> tuple[Rollout, int]:
        responses = []
        for g, _ in enumerate(samples):
            made.append((index, g))
            equal = g in EQUAL_GROUPS.get(index, set())
            responses += [digit * (1 if equal else j + 1 + index) + [eot] for j in range(GROUP)]
        out = _generation(tokenizer, responses, [True] * len(responses))
        rewards = objective.source.rewards.with_tokens(
            [s.prompt for s in samples for _ in range(GROUP)], out.token_lists()
        )
        return to_rollout(samples, GROUP, out, rewards, tokenizer), 0

    return sample


@pytest.mark.parametrize("max_rounds, rounds, filled", [(10, 3, 0), (2, 2, 2)])
def test_dynamic_sampling_trains_no_zero_advantage_group_and_keeps_the_batch_full(
    tokenizer, max_rounds: int, rounds: int, filled: int
) -> None:
    """4 groups per batch; round 0 gives 2 with a spread, round 1 none, round 2 three (the first two kept). With
    3 rounds allowed the batch is the 4 spread groups in the order made; with 2 it is filled up with round 0's
    equal groups, counted. Either way 16 rows, and the loss runs on them."""
    model = _model(tokenizer.vocab_size)
    objective = _objective(
        tokenizer, model, local_batch_size=4 * GROUP, dynamic_sampling=True, dynamic_sampling_max_rounds=max_rounds
    )
    made: list[tuple[int, int]] = []
    objective.source.sample = _scripted_sample(objective, tokenizer, made)
    prepared = objective.prepare([objective.next_microbatch()])
    (microbatch,) = prepared.batches
    advantages = microbatch.fields.advantages.view(-1, GROUP)
    assert advantages.shape == (4, GROUP) and objective.source.batches_made == rounds
    spread = advantages.abs().sum(dim=1) > 0
    assert spread.tolist() == [True] * (4 - filled) + [False] * filled
    assert len(made) == 4 * rounds

    metrics = _means(prepared)
    generated_equal = sum(len(EQUAL_GROUPS[r]) for r in range(rounds))
    assert metrics["grpo/generation_rounds"] == rounds
    assert metrics["grpo/zero_std_frac"] == pytest.approx(generated_equal / (4 * rounds))
    assert metrics["grpo/zero_std_trained"] == filled / 4
    result = objective.loss(ModelOutput(logits=model(**microbatch.model_inputs())), microbatch)
    assert torch.isfinite(result.loss_sum)

    # The prompts trained are those of the kept groups: round 0's groups 1 and 3, then round 2's 0 and 2 (or
    # round 0's equal groups 0 and 2 as the fill-up).
    stream = _objective(tokenizer, _model(tokenizer.vocab_size)).source._next_prompts(4 * rounds)
    kept = [(0, 1), (0, 3), (2, 0), (2, 2)] if not filled else [(0, 1), (0, 3), (0, 0), (0, 2)]
    prompt_width = microbatch.tokens.shape[1] - microbatch.fields.old_logprobs.shape[1]
    for row, (r, g) in zip(microbatch.tokens[::GROUP, :prompt_width].tolist(), kept):
        assert [t for t in row if t != tokenizer.pad_id] == stream[4 * r + g].prompt


def test_without_dynamic_sampling_the_batch_is_the_first_round_as_made(tokenizer) -> None:
    objective = _objective(tokenizer, _model(tokenizer.vocab_size), local_batch_size=4 * GROUP)
    made: list[tuple[int, int]] = []
    objective.source.sample = _scripted_sample(objective, tokenizer, made)
    prepared = objective.prepare([objective.next_microbatch()])
    assert objective.source.batches_made == 1 and len(made) == 4
    assert (prepared.batches[0].fields.advantages.view(-1, GROUP).abs().sum(dim=1) > 0).tolist() == [
        False,
        True,
        False,
        True,
    ]
    metrics = _means(prepared)
    assert metrics["grpo/zero_std_frac"] == 0.5 and "grpo/generation_rounds" not in metrics
