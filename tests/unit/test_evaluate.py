"""Exact-match evaluation: reading, scoring, eval/train mode, and the same forward count on every DP rank.

The "model" here is a bigram table (next token = table[current token]) that answers "42" to every
prompt, so the expected score is known exactly; the two-process case wraps it in FSDP2, where a rank
running one forward more than another would hang, and the ranks' local stopping times differ.
"""

from __future__ import annotations

import json
import math
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from titanium.config import ConfigError, load_config
from titanium.config.sections import DataSection, EvalSection, SFTSection
from titanium.data.chat import Llama3Template, Message
from titanium.data.sft import SFTDataset
from titanium.data.text import DataError
from titanium.data.tokenizer import DEFAULT_TOKENIZER_PATH, TiktokenTokenizer
from titanium.evaluation.exact_match import ExactMatchEvaluator

REPO = Path(__file__).resolve().parents[2]
REFERENCES = ["42", "41", " 42 ", "42", "7", "42", "4", "42", "42"]  # 6 of 9 match "42" after strip()


def _tokenizer() -> TiktokenTokenizer:
    return TiktokenTokenizer(str(REPO / DEFAULT_TOKENIZER_PATH))


def _chat_row(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


class BigramAnswerer(nn.Module):
    """Answers "42" then end-of-turn after the assistant header, or "4" forever (``never_stop``)."""

    def __init__(self, tokenizer: TiktokenTokenizer, template: Llama3Template, never_stop: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()  # no layers: the KV cache has nothing to hold
        self.weight = nn.Parameter(torch.zeros(4, 4))  # something for FSDP to gather on every forward
        four, two = tokenizer.encode("42", bos=False, eos=False)
        header_end = template.prompt([])[-1]
        table = torch.full((tokenizer.vocab_size,), four)
        table[header_end], table[four], table[two] = four, four if never_stop else two, template.eot
        self.register_buffer("table", table)
        self.vocab_size = tokenizer.vocab_size
        self.calls = 0
        self.modes: list[bool] = []

    def forward(self, tokens: torch.Tensor, **_: object) -> torch.Tensor:
        self.calls += 1
        self.modes.append(self.training)
        return F.one_hot(self.table[tokens], self.vocab_size).float() + self.weight.sum()


def _evaluator(
    path: str, *, max_samples: int = 100, data: DataSection | None = None, dp_rank: int = 0, dp_world: int = 1
) -> tuple[ExactMatchEvaluator, TiktokenTokenizer, Llama3Template]:
    tokenizer = _tokenizer()
    template = Llama3Template(tokenizer)
    cfg = EvalSection(interval=10, path=path, max_samples=max_samples, batch_size=2)
    data = data if data is not None else DataSection(kind="chat")
    evaluator = ExactMatchEvaluator(cfg, data, template, tokenizer, dp_rank=dp_rank, dp_world=dp_world)
    return evaluator, tokenizer, template


class WideAnswerer(nn.Module):
    """An output layer two ids wider than the tokenizer (as many published models have) answering "4", the first id
    past the tokenizer's, "2", then end-of-turn."""

    def __init__(self, tokenizer: TiktokenTokenizer, template: Llama3Template) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        self.vocab_size, past = tokenizer.vocab_size + 2, tokenizer.vocab_size
        four, two = tokenizer.encode("42", bos=False, eos=False)
        table = torch.full((self.vocab_size,), four)
        table[template.prompt([])[-1]], table[four], table[past], table[two] = four, past, two, template.eot
        self.register_buffer("table", table)

    def forward(self, tokens: torch.Tensor, **_: object) -> torch.Tensor:
        return F.one_hot(self.table[tokens], self.vocab_size).float()


def test_an_id_the_tokenizer_lacks_is_left_out_of_the_answer_as_transformers_does(tmp_path: Path) -> None:
    path = _write(tmp_path / "test.jsonl", [_chat_row("q", "42")])
    evaluator, tokenizer, template = _evaluator(path)
    assert evaluator(WideAnswerer(tokenizer, template)) == {"eval/exact_match": 1.0, "eval/samples": 1}


def test_scores_exact_matches_and_restores_train_mode(tmp_path: Path) -> None:
    path = _write(tmp_path / "test.jsonl", [_chat_row(f"q{i}", a) for i, a in enumerate(REFERENCES)])
    evaluator, tokenizer, template = _evaluator(path)
    model = BigramAnswerer(tokenizer, template).train()
    assert evaluator(model) == {"eval/exact_match": 6 / 9, "eval/samples": 9}
    assert model.training and not any(model.modes)
    # 5 batches of <= 2 prompts; each is a prefill, "2" and end-of-turn: 3 forwards, then all rows are done.
    assert model.calls == 5 * 3


def test_prompt_is_the_conversation_before_the_last_message(tmp_path: Path) -> None:
    row = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "What is 40 + 2?"},
            {"from": "gpt", "value": "42"},
        ]
    }
    data = DataSection(kind="chat", messages_column="conversations", role_key="from", content_key="value")
    evaluator, tokenizer, _ = _evaluator(_write(tmp_path / "sharegpt.jsonl", [row]), data=data)
    (sample,) = evaluator.mine
    assert sample.reference == "42"
    text = tokenizer.decode(sample.prompt)
    assert "Be brief." in text and "What is 40 + 2?" in text and "42<|eot_id|>" not in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_first_max_samples_rows_and_bad_rows(tmp_path: Path) -> None:
    rows = [_chat_row("q0", "42"), {"messages": "not a list"}, _chat_row("q2", "1"), _chat_row("q3", "42")]
    path = _write(tmp_path / "test.jsonl", rows)
    evaluator, tokenizer, template = _evaluator(path, max_samples=3)
    assert [s.reference for s in evaluator.mine] == ["42", "1"]  # row 1 skipped, row 3 beyond max_samples
    assert evaluator(BigramAnswerer(tokenizer, template)) == {"eval/exact_match": 0.5, "eval/samples": 2}
    with pytest.raises(DataError, match="row 1"):
        _evaluator(path, data=DataSection(kind="chat", on_bad_row="fail"))
    with pytest.raises(DataError, match="--eval.path"):
        _evaluator(str(tmp_path / "missing.jsonl"))


def test_broken_lines_are_bad_rows_named_by_file_and_row(tmp_path: Path) -> None:
    good = [json.dumps(_chat_row(f"q{i}", "42")).encode() for i in range(3)]
    path = tmp_path / "test.jsonl"
    path.write_bytes(b"\n".join([good[0], b'{"messages": oops', good[1], b"\xff", good[2]]) + b"\n")
    evaluator, _, _ = _evaluator(str(path))
    assert len(evaluator.mine) == 3
    with pytest.raises(DataError, match=rf"--eval.path {path}: row 1: not valid JSON .*; fix or delete the line"):
        _evaluator(str(path), data=DataSection(kind="chat", on_bad_row="fail"))


def test_system_prompt_is_used_as_in_training(tmp_path: Path) -> None:
    """--chat.system_prompt replaces or adds the system message of eval prompts exactly as of SFT samples."""
    rows = [
        _chat_row("What is 40 + 2?", "42"),
        {"messages": [{"role": "system", "content": "old"}, *_chat_row("q", "7")["messages"]]},
    ]
    tokenizer = _tokenizer()
    template = Llama3Template(tokenizer)
    cfg = EvalSection(interval=1, path=_write(tmp_path / "t.jsonl", rows))
    evaluator = ExactMatchEvaluator(cfg, DataSection(kind="chat"), template, tokenizer, system_prompt="Be brief.")
    expected = [
        template.prompt([Message("system", "Be brief."), Message("user", "What is 40 + 2?")]),
        template.prompt([Message("system", "Be brief."), Message("user", "q")]),
    ]
    assert [s.prompt for s in evaluator.mine] == expected
    # The training sample of the same row starts with exactly the eval prompt, then the answer.
    sft = SFTDataset(
        DataSection(kind="chat", path=cfg.path), SFTSection(), tokenizer, template, 256, system_prompt="Be brief."
    )
    sample = next(iter(sft))["tokens"]
    assert sample[: len(expected[0])] == expected[0]
    assert tokenizer.decode(sample[len(expected[0]) :]) == "42<|eot_id|>"


def test_prompt_too_long_for_the_model_is_refused_before_generating(tmp_path: Path) -> None:
    evaluator, tokenizer, template = _evaluator(_write(tmp_path / "t.jsonl", [_chat_row("q", "42")]))
    model = BigramAnswerer(tokenizer, template)
    model.args = type("Args", (), {"max_seq_len": 8})()
    with pytest.raises(ValueError, match="positions"):
        evaluator(model)
    assert model.calls == 0


def _dp_worker(rank: int, world: int, store: str, path: str, results: dict) -> None:
    from torch.distributed.fsdp import fully_shard

    timeout = timedelta(seconds=60)  # a rank running one forward too many fails the test instead of hanging it
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timeout)
    try:
        evaluator, tokenizer, template = _evaluator(path, dp_rank=rank, dp_world=world)
        # Rank 1's rows never stop: rank 0 is done first and must keep stepping with it.
        model = BigramAnswerer(tokenizer, template, never_stop=rank == 1)
        fully_shard(model)
        results[rank] = (evaluator(model), model.calls, len(evaluator.mine))
    finally:
        dist.destroy_process_group()


def test_data_parallel_ranks_split_rows_and_run_the_same_forwards(tmp_path: Path) -> None:
    path = _write(tmp_path / "test.jsonl", [_chat_row(f"q{i}", a) for i, a in enumerate(REFERENCES)])
    results = mp.Manager().dict()
    mp.spawn(_dp_worker, args=(2, str(tmp_path / "store"), path, results), nprocs=2, join=True)
    (metrics0, calls0, mine0), (metrics1, calls1, mine1) = results[0], results[1]
    assert (mine0, mine1) == (5, 4)  # rows 0,2,4,6,8 and 1,3,5,7; rank 1 pads its share with a dummy prompt
    # Rank 0 answers "42" (its references: 42, 42, 7, 4, 42 -> 3 right); rank 1 says "4444..." (0 right).
    assert metrics0 == metrics1 == {"eval/exact_match": 3 / 9, "eval/samples": 9}
    assert calls0 == calls1 == 3 * 16  # 3 batches, each a prefill and 15 steps (max_new_tokens=16)


def test_evaluator_needs_a_usable_row(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no usable"):
        _evaluator(_write(tmp_path / "t.jsonl", [{"messages": []}]))


class TwoAnswerSampler(nn.Module):
    """After the assistant header: "42" with probability 3/4, "7" with 1/4, each then end-of-turn."""

    def __init__(self, tokenizer: TiktokenTokenizer, template: Llama3Template) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        four, two = tokenizer.encode("42", bos=False, eos=False)
        (seven,) = tokenizer.encode("7", bos=False, eos=False)
        logits = torch.full((tokenizer.vocab_size, tokenizer.vocab_size), -1e4)
        logits[:, template.eot] = 0.0  # anything else ends the turn
        header_end = template.prompt([])[-1]
        logits[header_end] = -1e4
        logits[header_end, four], logits[header_end, seven] = math.log(0.75), math.log(0.25)
        logits[four] = -1e4
        logits[four, two] = 0.0
        self.register_buffer("logits", logits)

    def forward(self, tokens: torch.Tensor, **_: object) -> torch.Tensor:
        return self.logits[tokens]


def test_sampled_answers_score_their_expected_accuracy(tmp_path: Path) -> None:
    """--eval.temperature 1 --eval.samples_per_prompt 64: 6 "42" and 2 "7" references against a model that
    says "42" 3/4 of the time score (6 x 3/4 + 2 x 1/4) / 8 = 0.625 (3 sigma: 0.057); greedy would score
    0.75. Every evaluation draws from the same seed."""
    path = _write(tmp_path / "test.jsonl", [_chat_row(f"q{i}", a) for i, a in enumerate(["42"] * 6 + ["7"] * 2)])
    tokenizer = _tokenizer()
    template = Llama3Template(tokenizer)
    cfg = EvalSection(interval=1, path=path, batch_size=128, temperature=1.0, samples_per_prompt=64)
    evaluator = ExactMatchEvaluator(cfg, DataSection(kind="chat"), template, tokenizer)
    model = TwoAnswerSampler(tokenizer, template)
    scores = evaluator(model)
    assert scores["eval/samples"] == 8 and scores["eval/exact_match"] == pytest.approx(0.625, abs=0.057)
    assert evaluator(model) == scores
    greedy = ExactMatchEvaluator(EvalSection(interval=1, path=path), DataSection(kind="chat"), template, tokenizer)
    assert greedy(model)["eval/exact_match"] == 0.75


@pytest.mark.parametrize(
    "args, message",
    [
        (["--eval.temperature", "-1"], "--eval.temperature must be >= 0"),
        (["--eval.samples_per_prompt", "4"], "--eval.samples_per_prompt > 1 needs --eval.temperature > 0"),
        (["--eval.temperature", "1", "--eval.samples_per_prompt", "0"], "--eval.samples_per_prompt must be >= 1"),
    ],
)
def test_bad_sampling_options_are_reported(args: list[str], message: str, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match=message):
        load_config(args)
