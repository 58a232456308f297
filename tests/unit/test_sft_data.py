"""SFT data: samples and shifted labels, column maps, bad rows, long samples, resume; packing and padding rows."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from titanium.config.sections import DataSection, SFTSection
from titanium.data.chat import Llama3Template, Message
from titanium.data.loader import BatchLoader
from titanium.data.packing import PackedDataset, padded_rows
from titanium.data.sft import IGNORE_INDEX, SFTDataset
from titanium.data.text import DataError
from titanium.data.tokenizer import ByteTokenizer
from titanium.objectives import base

TOK = ByteTokenizer()
TEMPLATE = Llama3Template(TOK)
EOT = TOK.special_tokens["<|eot_id|>"]


def jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def chat(user: str, answer: str, system: str | None = None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    return {"messages": [*messages, {"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def dataset(path: str, seq_len: int = 256, kind: str = "chat", **options: Any) -> SFTDataset:
    data_keys = set(DataSection.__dataclass_fields__)
    data = DataSection(kind=kind, path=path, **{k: v for k, v in options.items() if k in data_keys})  # type: ignore[arg-type]
    system_prompt = options.pop("system_prompt", None)
    sft = SFTSection(**{k: v for k, v in options.items() if k not in data_keys})
    return SFTDataset(data, sft, TOK, TEMPLATE, seq_len, system_prompt=system_prompt)


def take(iterable, n: int) -> list:
    it = iter(iterable)
    return [next(it) for _ in range(n)]


def test_ignore_index_is_the_losses():
    assert IGNORE_INDEX == base.IGNORE_INDEX


@pytest.mark.parametrize("train_on_input", [False, True])
def test_chat_sample_labels_are_shifted_and_masked(tmp_path, train_on_input):
    ds = dataset(jsonl(tmp_path / "c.jsonl", [chat("hi", "yo")]), train_on_input=train_on_input)
    sample = take(ds, 1)[0]
    tokens = sample["tokens"]
    assert tokens == TEMPLATE.tokenize([Message("user", "hi"), Message("assistant", "yo")], False)[0]
    assert tokens[-3:] == [ord("y"), ord("o"), EOT]
    if train_on_input:
        assert sample["labels"] == [*tokens[1:], IGNORE_INDEX]
    else:
        assert sample["labels"] == [IGNORE_INDEX] * (len(tokens) - 4) + [ord("y"), ord("o"), EOT, IGNORE_INDEX]


def test_sharegpt_and_instruct_columns_give_the_same_samples(tmp_path):
    expected = take(dataset(jsonl(tmp_path / "c.jsonl", [chat("Add.\n\n2 3", "5", system="S")])), 1)
    share = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Add.\n\n2 3"}]}
    share["conversations"].append({"from": "gpt", "value": "5"})
    options = dict(messages_column="conversations", role_key="from", content_key="value")
    assert take(dataset(jsonl(tmp_path / "s.jsonl", [share]), **options), 1) == expected
    row = {"q": "Add.", "extra": "2 3", "a": "5"}
    options = dict(instruction_column="q", input_column="extra", output_column="a", system_prompt="S")
    assert take(dataset(jsonl(tmp_path / "i.jsonl", [row]), kind="instruct", **options), 1) == expected


def test_system_prompt_replaces_the_rows_own(tmp_path):
    path = jsonl(tmp_path / "c.jsonl", [chat("q", "a", system="old")])
    expected = take(dataset(jsonl(tmp_path / "d.jsonl", [chat("q", "a", system="S")])), 1)
    assert take(dataset(path, system_prompt="S"), 1) == expected


def test_text_kind_is_a_completion_sample(tmp_path):
    sample = take(dataset(jsonl(tmp_path / "t.jsonl", [{"body": "abc"}]), kind="text", text_column="body"), 1)[0]
    assert sample["tokens"] == [TOK.bos_id, 97, 98, 99, TOK.eos_id]
    assert sample["labels"] == [97, 98, 99, TOK.eos_id, IGNORE_INDEX]


BAD_ROWS = [
    chat("q0", "a0"),
    {"other": 1},
    chat("q2", "a2"),
    {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
    chat("q4", "a4"),
]


def test_bad_rows_are_skipped_and_counted(tmp_path, caplog):
    ds = dataset(jsonl(tmp_path / "c.jsonl", BAD_ROWS))
    samples = take(ds, 3)
    assert [TOK.decode(s["tokens"][-3:-1]) for s in samples] == ["a0", "a2", "a4"]
    assert ds.bad_rows == 2
    assert "c.jsonl: row 3: message 0 has unknown role 'robot'" in caplog.text


def test_bad_rows_fail_with_file_and_row(tmp_path):
    path = jsonl(tmp_path / "c.jsonl", BAD_ROWS)
    with pytest.raises(DataError, match=rf"--data.path {path}: row 1: no 'messages' column .*--data.messages_column"):
        take(dataset(path, on_bad_row="fail"), 3)
    path = jsonl(tmp_path / "i.jsonl", [{"instruction": "x", "output": " "}])
    with pytest.raises(DataError, match=rf"--data.path {path}: row 0: 'output' is empty; .*--data.output_column"):
        take(dataset(path, kind="instruct", on_bad_row="fail"), 1)


def test_broken_lines_in_chat_data_are_bad_rows(tmp_path, caplog):
    path = tmp_path / "c.jsonl"
    lines = [
        json.dumps(chat("q0", "a0")).encode(),
        b'{"messages": [',
        b"\xff\xfe",
        json.dumps(chat("q3", "a3")).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    ds = dataset(str(path))
    assert [TOK.decode(s["tokens"][-3:-1]) for s in take(ds, 2)] == ["a0", "a3"]
    assert ds.bad_rows == 2 and f"--data.path {path}: row 2: not UTF-8 text" in caplog.text
    with pytest.raises(DataError, match=rf"--data.path {path}: row 1: not valid JSON"):
        take(dataset(str(path), on_bad_row="fail"), 2)


def test_a_pass_without_any_sample_is_an_error_not_a_hang(tmp_path):
    with pytest.raises(DataError, match="a whole pass gave data-parallel rank 0 of 1 nothing to train on"):
        take(dataset(jsonl(tmp_path / "c.jsonl", [{"other": 1}] * 3)), 1)


def test_long_samples_are_truncated_or_dropped(tmp_path, caplog):
    short, long_answer, long_prompt = chat("q", "a"), chat("q", "x" * 40), chat("u" * 40, "a")
    path = jsonl(tmp_path / "c.jsonl", [short, long_answer, long_prompt, short, long_answer, long_prompt])
    ds = dataset(path, seq_len=30)
    samples = take(ds, 4)  # the long prompt leaves nothing to learn: dropped
    assert [len(s["tokens"]) for s in samples] == [26, 30, 26, 30]
    assert samples[1]["labels"][-1] == IGNORE_INDEX and samples[1]["labels"][-2] == ord("x")
    assert (ds.truncated, ds.dropped) == (2, 1)
    # One warning per kind, naming an example row; the counts go to the log line.
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2
    assert warnings[0].startswith(f"--data.path {path}: row 1: a sample of 65 tokens is longer than")
    assert "--training.seq_len 30; cut to 30 tokens" in warnings[0] and "'truncated'" in warnings[0]
    assert warnings[1].startswith(f"--data.path {path}: row 2: the prompt alone is 63 tokens")
    assert "nothing to learn within --training.seq_len 30; dropped" in warnings[1] and "'dropped'" in warnings[1]
    caplog.clear()
    ds = dataset(path, seq_len=30, on_long_sample="drop")
    assert [len(s["tokens"]) for s in take(ds, 2)] == [26, 26]
    assert (ds.truncated, ds.dropped) == (0, 2)
    assert "row 1: a sample of 65 tokens is longer than --training.seq_len 30; dropped" in caplog.text


def test_dp_ranks_read_disjoint_rows_and_loop_over_epochs(tmp_path):
    path = jsonl(tmp_path / "c.jsonl", [chat("q", f"a{i}") for i in range(6)])
    data = DataSection(kind="chat", path=path)
    answers = []
    for rank in range(2):
        ds = SFTDataset(data, SFTSection(), TOK, TEMPLATE, 256, dp_rank=rank, dp_world=2)
        answers.append([TOK.decode(s["tokens"][-3:-1]) for s in take(ds, 4)])
        assert ds.epoch == 1
    assert answers == [["a0", "a1", "a2", "a0"], ["a3", "a4", "a5", "a3"]]  # each rank: half the bytes


def test_sft_dataset_resumes_exactly(tmp_path):
    path = jsonl(tmp_path / "c.jsonl", [BAD_ROWS[1], chat("q", "x" * 40)] + [chat("q", f"a{i}") for i in range(4)])
    ref = dataset(path, seq_len=30)
    it = iter(ref)
    take(it, 3)
    state = json.loads(json.dumps(ref.state_dict()))
    expected = take(it, 5)  # crosses an epoch
    resumed = dataset(path, seq_len=30)
    resumed.load_state_dict(state)
    assert take(resumed, 5) == expected
    assert (resumed.bad_rows, resumed.truncated) == (ref.bad_rows, ref.truncated) == (2, 2)


# ------------------------------------------------------------------------------------------- packing

PAD = 999


class ListStream:
    """A finite resumable sample stream that counts what was pulled from it."""

    def __init__(self, samples: list[dict[str, list[int]]]) -> None:
        self.samples, self.index = samples, 0

    def __iter__(self) -> Iterator[dict[str, list[int]]]:
        while self.index < len(self.samples):
            self.index += 1
            yield self.samples[self.index - 1]

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = state["index"]


def random_samples(n: int, seq_len: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """Sample k starts with token k (so rows can be traced back); labels mix targets and IGNORE_INDEX."""
    rng = random.Random(seed)
    samples = []
    for k in range(n):
        length = rng.choice([1, 2, 5, seq_len // 3, seq_len // 2, seq_len - 3, seq_len])
        tokens = [k] + [rng.randrange(100) for _ in range(length - 1)]
        labels = [t if rng.random() < 0.5 else IGNORE_INDEX for t in tokens[1:]] + [IGNORE_INDEX]
        samples.append({"tokens": tokens, "labels": labels})
    return samples


def unpack(row: dict[str, torch.Tensor]) -> list[dict[str, list[int]]]:
    """Split a row back into its samples by document id, checking positions, padding and key shapes."""
    seq_len = row["input"].shape[0]
    assert all(v.shape == (seq_len,) and v.dtype == torch.long for v in row.values())
    docs = row["document_ids"].tolist()
    assert docs[0] == 0 and all(b - a in (0, 1) for a, b in zip(docs, docs[1:]))
    samples = []
    for d in range(docs[-1] + 1):
        idx = [i for i, doc in enumerate(docs) if doc == d]
        assert row["positions"][idx].tolist() == list(range(len(idx)))
        part = {"tokens": row["input"][idx].tolist(), "labels": row["label"][idx].tolist()}
        if set(part["tokens"]) == {PAD}:  # padding: its own document, at the end, no loss
            assert d == docs[-1] and set(part["labels"]) == {IGNORE_INDEX}
        else:
            samples.append(part)
    return samples


def test_packing_keeps_samples_whole_and_the_buffer_bounded():
    samples, seq_len, buffer_size = random_samples(60, 32), 32, 4
    stream = ListStream(samples)
    packed = PackedDataset(stream, seq_len, PAD, buffer_size)
    out, firsts, emitted = [], [], 0
    for row in packed:
        parts = unpack(row)
        emitted += len(parts)
        assert len(packed.buffer) <= buffer_size and stream.index == emitted + len(packed.buffer)
        firsts.append(parts[0]["tokens"][0])
        out += parts
    key = lambda s: (s["tokens"], s["labels"])  # noqa: E731
    assert sorted(out, key=key) == sorted(samples, key=key)  # every sample once, whole, labels intact
    assert firsts == sorted(firsts)  # each row starts with the oldest buffered sample
    total = sum(len(s["tokens"]) for s in samples)
    assert len(firsts) < len(samples) and len(firsts) * seq_len < 1.4 * total  # it does pack


def test_padding_one_sample_per_row():
    samples = [{"tokens": [5, 6, 7], "labels": [6, 7, IGNORE_INDEX]}, {"tokens": [1, 2, 3, 4], "labels": [2] * 4}]
    batch = padded_rows(samples, 4, PAD, "seq_len")
    rows = [{k: v[i] for k, v in batch.items()} for i in range(2)]
    assert rows[0]["input"].tolist() == [5, 6, 7, PAD] and rows[0]["label"].tolist() == [6, 7, -100, -100]
    assert rows[0]["positions"].tolist() == [0, 1, 2, 0] and rows[0]["document_ids"].tolist() == [0, 0, 0, 1]
    assert rows[1]["document_ids"].tolist() == [0] * 4 and rows[1]["positions"].tolist() == [0, 1, 2, 3]
    assert [unpack(r) for r in rows] == [[s] for s in samples]
    for pad_to in ("seq_len", "longest"):
        with pytest.raises(ValueError, match="longer than seq_len=3"):
            padded_rows(samples, 3, PAD, pad_to)


def test_padding_to_the_longest_cuts_only_padding_columns():
    """pad_to longest: the seq_len-wide batch with the columns no sample uses cut off, bucketed (bucket_width)."""
    samples = [{"tokens": list(range(1, n + 1)), "labels": [2] * n} for n in (3, 11, 7)]
    full = padded_rows(samples, 64, PAD, "seq_len")
    short = padded_rows(samples, 64, PAD, "longest", pad_multiple=8)
    assert short["input"].shape == (3, 16)  # 11 rounded up to a multiple of 8
    assert all(torch.equal(short[k], full[k][:, :16]) for k in full)
    assert padded_rows(samples, 12, PAD, "longest", pad_multiple=8)["input"].shape == (3, 12)  # capped at seq_len


@pytest.mark.parametrize("packing", [True, False])
def test_packed_and_padded_batches_resume_identically(tmp_path, packing):
    rng = random.Random(1)
    rows = [chat("q" * rng.randrange(1, 30), "a" * rng.randrange(1, 40)) for _ in range(12)]
    path = jsonl(tmp_path / "c.jsonl", rows)

    def loader() -> BatchLoader:
        ds = dataset(path, seq_len=64)
        if packing:
            return BatchLoader(PackedDataset(ds, 64, PAD, 3), batch_size=2)
        return BatchLoader(ds, batch_size=2, collate_fn=partial(padded_rows, seq_len=64, pad_id=PAD, pad_to="seq_len"))

    ref = loader()
    take(ref, 3)
    state = json.loads(json.dumps(ref.state_dict()))
    if packing:
        assert state["buffer"], "the saved state should hold buffered samples"
    expected = take(ref, 4)  # crosses an epoch
    resumed = loader()
    resumed.load_state_dict(state)
    got = take(resumed, 4)
    assert got[0]["input"].shape == (2, 64) and set(got[0]) == {"input", "label", "positions", "document_ids"}
    for a, b in zip(expected, got):
        assert all(torch.equal(a[k], b[k]) for k in a)
