"""Reward functions: answer extraction and matching, the format reward, user functions by import path,
weighted sums with per-function values, and the errors for bad names and bad return values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO
from titanium.config import ConfigError
from titanium.config.sections import RLSection
from titanium.errors import UserError
from titanium.rl.rewards.functions import RewardSet, exact_match, extract_answer, normalize_answer, think_format


@pytest.mark.parametrize(
    "text, answer",
    [
        ("0 4 6 8", "0 4 6 8"),
        ("so we get \\boxed{12} and then \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", " 72"),
        ("First 3, then 4. The answer is 7.", "7."),
        ("<think>maybe \\boxed{3}?</think> Answer: 5", "5"),
        ("\\boxed{unclosed", "\\boxed{unclosed"),
    ],
)
def test_extract_answer(text: str, answer: str) -> None:
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    "raw, normal",
    [(" 0 4  6 8 ", "0 4 6 8"), ("1,000.50", "1000.5"), ("$5$", "5"), ("42.", "42"), ("+3", "3"), ("-0.0", "0")],
)
def test_normalize_answer(raw: str, normal: str) -> None:
    assert normalize_answer(raw) == normal


def test_exact_match_on_the_bundled_task_data() -> None:
    rows = [json.loads(line) for line in (REPO / "assets/tasks/arithmetic/test.jsonl").read_text().splitlines()]
    rows = rows[:50]
    reference = [r["messages"][-1]["content"] for r in rows]
    assert all(exact_match(ref, r["answer"], r) == 1.0 for ref, r in zip(reference, rows))
    shifted = reference[1:] + reference[:1]
    wrong = [exact_match(s, r["answer"], r) for s, r in zip(shifted, rows)]
    assert sum(wrong) < 10  # another row's answer is (almost always) wrong
    assert exact_match("The answer is 1,000.", "1000", {}) == 1.0
    assert exact_match("\\boxed{72}", "48 + 24 = 72 clips.\n#### 72", {}) == 1.0  # a GSM8K reference
    assert exact_match("<think>2 + 2 = 4</think>\\boxed{4}", "5", {}) == 0.0
    with pytest.raises(UserError, match="--rl.answer_column"):
        exact_match("4", None, {})


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("<think>2 + 2 is 4</think> 4", 1.0),
        ("  <think>a\nb</think>\n\\boxed{4}", 1.0),
        ("4", 0.0),
        ("<think>no answer after</think>  ", 0.0),
        ("<think></think> 4", 0.0),
        ("<think>a<think>b</think> 4", 0.0),
        ("x <think>a</think> 4", 0.0),
    ],
)
def test_format_reward(completion: str, reward: float) -> None:
    assert think_format(completion, None, {}) == reward


def test_weighted_sum_keeps_each_function_and_imports_user_functions(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "my_rewards.py").write_text(
        "def shortness(completion, answer, row):\n    return -len(completion) / row['scale']\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = RewardSet.from_config(
        RLSection(rewards=["exact_match", "format", "my_rewards:shortness"], reward_weights=[1.0, 0.5, 0.1])
    )
    completions = ["<think>x</think> 42", "42", "<think>y</think> 41"]
    rows = [{"scale": 10}] * 3
    out = rewards(completions, ["42"] * 3, rows)
    assert out.per_function["exact_match"].tolist() == [1.0, 1.0, 0.0]
    assert out.per_function["format"].tolist() == [1.0, 0.0, 1.0]
    shortness = [-len(c) / 10 for c in completions]
    assert out.per_function["my_rewards:shortness"].tolist() == pytest.approx(shortness)
    expected = [e + 0.5 * f + 0.1 * s for e, f, s in zip([1, 1, 0], [1, 0, 1], shortness)]
    assert out.total.tolist() == pytest.approx(expected) and out.total.dtype == torch.float32
    assert RewardSet(["format"])(["4"], [None], [{}]).total.tolist() == [0.0]  # default weight 1


def test_bad_reward_names_and_values(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "bad_rewards.py").write_text(
        "def text(c, a, r):\n    return 'yes'\n"
        "def nan(c, a, r):\n    return float('nan')\n"
        "def boom(c, a, r):\n    raise KeyError('solution')\n"
        "NOT_A_FUNCTION = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec, message in [
        ("exact", "'exact' is not a known reward function; valid: exact_match, format"),
        ("no_such_module:f", "cannot import no_such_module:f (No module named 'no_such_module')"),
        ("bad_rewards:missing", "module 'bad_rewards' has no attribute 'missing'"),
        ("bad_rewards:NOT_A_FUNCTION", "'bad_rewards:NOT_A_FUNCTION' is not a function"),
    ]:
        with pytest.raises(ConfigError, match="--rl.rewards") as err:
            RewardSet([spec])
        assert message in str(err.value)
    for spec in ("bad_rewards:text", "bad_rewards:nan"):
        with pytest.raises(UserError, match=f"reward function '{spec}' returned"):
            RewardSet([spec])(["4"], ["4"], [{}])
    with pytest.raises(RuntimeError, match="reward function 'bad_rewards:boom' failed on the response '4'"):
        RewardSet(["bad_rewards:boom"])(["4"], ["4"], [{}])


def test_trl_batched_rewards_file_paths_and_wrong_signatures(tmp_path: Path) -> None:
    """TRL's batched ``fn(completions, **kwargs) -> list[float]`` gets the responses and each row column as a list;
    a function given by file path is loaded; a function of neither form is refused when the set is built (at
    start-up; it used to fail only after the first rollout, with a traceback)."""
    path = tmp_path / "trl_rewards.py"
    path.write_text(
        "def lengths(completions, **kwargs):\n    return [len(c) * s for c, s in zip(completions, kwargs['scale'])]\n"
        "def one(completion, answer, row):\n    return 1.0\n"
        "def two_args(completion, answer):\n    return 1.0\n"
        "def short(completions, **kwargs):\n    return [1.0]\n"
    )
    rewards = RewardSet([f"{path}:lengths", f"{path}:one"])
    out = rewards(["ab", "abcd"], [None, None], [{"scale": 1}, {"scale": 10}])
    assert out.per_function[f"{path}:lengths"].tolist() == [2.0, 40.0]
    assert out.total.tolist() == [3.0, 41.0]
    with pytest.raises(ConfigError) as err:
        RewardSet([f"{path}:two_args"])
    assert str(err.value).startswith(f"--rl.rewards '{path}:two_args': two_args(completion, answer) cannot be ")
    assert "fn(completion, answer, row) -> float, or as TRL's batched fn(completions, **kwargs)" in str(err.value)
    with pytest.raises(UserError, match="returned list for 2 completions; a batched reward function returns"):
        RewardSet([f"{path}:short"])(["a", "b"], [None, None], [{}, {}])
    with pytest.raises(ConfigError, match=f"no file {tmp_path}/nothing.py"):
        RewardSet([f"{tmp_path}/nothing.py:f"])
    with pytest.raises(ConfigError, match="trl_rewards.py has no 'missing'"):
        RewardSet([f"{path}:missing"])


def test_batched_rewards_get_each_responses_prompt_as_trl_passes_it() -> None:
    """A TRL reward function reads ``prompts``: the objective binds each response's prompt (the text, or the
    conversation as role/content dicts, as the policy saw it) with the ids; ``PromptSample.trl_prompt`` makes it."""
    from titanium.data.chat import Message
    from titanium.data.prompts import PromptSample

    seen = {}

    def reads_prompts(completions, prompts, **kwargs):
        seen.update(prompts=prompts, ids=kwargs["prompt_ids"])
        return [float(len(p)) for p in prompts]

    chat = PromptSample([1, 2], None, {}, messages=(Message("system", "be brief"), Message("user", "2 + 3?")))
    text = PromptSample([1, 3], None, {}, "the quick")
    prompts = [chat.trl_prompt, text.trl_prompt]
    assert prompts == [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "2 + 3?"}], "the quick"]
    assert (chat.as_written, text.as_written) == ("2 + 3?", "the quick")
    rewards = RewardSet(["mine"], [], {"mine": reads_prompts}).with_tokens([[1, 2], [1, 3]], [[5], [6]], prompts)
    out = rewards(["5", " brown fox"], [None, None], [{}, {}])
    assert seen == {"prompts": prompts, "ids": [[1, 2], [1, 3]]} and out.total.tolist() == [2.0, 9.0]
