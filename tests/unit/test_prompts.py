"""GRPO prompt rows: chat / instruct / text prompts with their answers, bad and long rows, the
data-parallel split and an exact resume."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from tests.helpers import REPO
from titanium.config.sections import DataSection, RLSection
from titanium.data.chat import Llama3Template, Message
from titanium.data.prompts import PromptDataset
from titanium.data.text import DataError
from titanium.data.tokenizer import DEFAULT_TOKENIZER_PATH, TiktokenTokenizer

TASKS = str(REPO / "assets/tasks/arithmetic/train.jsonl")


@pytest.fixture(scope="module")
def tokenizer() -> TiktokenTokenizer:
    return TiktokenTokenizer(str(REPO / DEFAULT_TOKENIZER_PATH))


def _write(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _dataset(tokenizer, path: str, kind: str = "chat", **grpo) -> PromptDataset:
    data = DataSection(kind=kind, path=path)
    template = Llama3Template(tokenizer) if kind != "text" else None
    return PromptDataset(data, RLSection(**grpo), tokenizer, template)


def test_chat_rows_of_the_task_data(tokenizer) -> None:
    rows = [json.loads(line) for line in itertools.islice(open(TASKS), 6)]
    samples = list(itertools.islice(_dataset(tokenizer, TASKS), 6))
    template = Llama3Template(tokenizer)
    for sample, row in zip(samples, rows):
        question = row["messages"][0]["content"]
        assert sample.prompt == template.prompt([Message("user", question)])  # the answer message is dropped
        assert sample.answer == row["answer"] and sample.row == row


def test_prompt_kinds_answers_and_system_prompt(tmp_path: Path, tokenizer) -> None:
    chat = _write(
        tmp_path / "chat.jsonl",
        [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}], "answer": 4}],
    )
    (sample,) = itertools.islice(_dataset(tokenizer, chat), 1)
    assert sample.answer == "4"  # a number becomes a string
    text = tokenizer.decode(sample.prompt)
    assert "Be brief." in text and text.endswith("2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    data = DataSection(kind="chat", path=chat)
    override = PromptDataset(data, RLSection(), tokenizer, Llama3Template(tokenizer), system_prompt="Think.")
    assert "Think." in tokenizer.decode(next(iter(override)).prompt)

    instruct = _write(tmp_path / "instruct.jsonl", [{"instruction": "Add", "input": "2 and 2", "answer": "4"}])
    (sample,) = itertools.islice(_dataset(tokenizer, instruct, kind="instruct"), 1)
    assert sample.prompt == Llama3Template(tokenizer).prompt([Message("user", "Add\n\n2 and 2")])

    plain = _write(tmp_path / "text.jsonl", [{"text": "Q: 2+2? A:", "solution": "4"}])
    (sample,) = itertools.islice(_dataset(tokenizer, plain, kind="text", answer_column="solution"), 1)
    assert sample.prompt == tokenizer.encode("Q: 2+2? A:", bos=True, eos=False) and sample.answer == "4"
    (sample,) = itertools.islice(_dataset(tokenizer, plain, kind="text", answer_column=""), 1)
    assert sample.answer is None


def test_bad_and_long_rows_are_skipped_and_counted(tmp_path: Path, tokenizer, caplog) -> None:
    def chat(question: str, answer: object = "1") -> dict:
        return {"messages": [{"role": "user", "content": question}], "answer": answer}

    rows = [
        chat("ok 0"),
        {"messages": [{"role": "assistant", "content": "no question"}], "answer": "1"},
        chat("no answer", answer=None),
        chat("list answer", answer=[1]),
        chat("long " * 200),
        {"messages": "not a list", "answer": "1"},
        chat("ok 6"),
    ]
    path = _write(tmp_path / "rows.jsonl", rows)
    dataset = _dataset(tokenizer, path, max_prompt_len=64)
    samples = list(itertools.islice(dataset, 2))
    assert [s.row["messages"][0]["content"] for s in samples] == ["ok 0", "ok 6"]
    assert (dataset.bad_rows, dataset.too_long) == (4, 1)
    strict = PromptDataset(
        DataSection(kind="chat", path=path, on_bad_row="fail"), RLSection(), tokenizer, Llama3Template(tokenizer)
    )
    with pytest.raises(DataError, match=r"rows.jsonl: row 1: no user message to answer"):
        list(itertools.islice(strict, 2))
    assert "row 2: the answer column 'answer' is missing or null" in caplog.text
    assert "row 3: the answer column 'answer' is list, not a string or number" in caplog.text


def test_prompt_errors_name_the_rl_keys(tokenizer, tmp_path) -> None:
    """Every RL objective reads prompts with the same reader: its messages name [rl]'s keys."""
    path = _write(tmp_path / "rows.jsonl", [{"messages": [{"role": "user", "content": "2+2"}]}])
    data = DataSection(kind="chat", path=path, on_bad_row="fail")
    dataset = PromptDataset(data, RLSection(answer_column="answer"), tokenizer, Llama3Template(tokenizer))
    with pytest.raises(DataError, match=r"set --rl.answer_column, or '' for rows without answers"):
        next(iter(dataset))


def test_data_parallel_split_and_exact_resume(tokenizer) -> None:
    data = DataSection(kind="chat", path=TASKS, shards=2)  # one process reads both halves in turn

    def prompts(dp_rank: int, dp_world: int) -> PromptDataset:
        return PromptDataset(data, RLSection(), tokenizer, Llama3Template(tokenizer), None, dp_rank, dp_world)

    in_turn = [s.answer for s in itertools.islice(prompts(0, 1), 12)]
    assert [s.answer for s in itertools.islice(prompts(0, 2), 6)] == in_turn[0::2]
    assert [s.answer for s in itertools.islice(prompts(1, 2), 6)] == in_turn[1::2]
    whole = [s.answer for s in itertools.islice(_dataset(tokenizer, TASKS), 12)]

    first = _dataset(tokenizer, TASKS)
    stream = iter(first)
    for _ in range(5):
        next(stream)
    resumed = _dataset(tokenizer, TASKS)
    resumed.load_state_dict(first.state_dict())
    assert [s.answer for s in itertools.islice(resumed, 7)] == whole[5:12]


def test_a_pass_with_every_prompt_too_long_says_why(tmp_path: Path, tokenizer) -> None:
    rows = [{"messages": [{"role": "user", "content": "long " * 200}], "answer": "1"}] * 3
    with pytest.raises(DataError) as error:
        next(iter(_dataset(tokenizer, _write(tmp_path / "rows.jsonl", rows), max_prompt_len=64)))
    assert "nothing to train on (3 prompts longer than --rl.max_prompt_len 64 tokens skipped: raise it" in str(
        error.value
    )
