"""Text data: windows, document boundaries, DP sharding, exact resume, bad rows, synthetic data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from titanium.config.sections import DataSection
from titanium.data.loader import BatchLoader
from titanium.data.synthetic import SyntheticDataset
from titanium.data.text import DataError, TextDataset
from titanium.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def docs(n: int) -> list[dict]:
    return [{"text": f"document number {i} " + "abc" * (i % 5)} for i in range(n)]


def take(loader, n):
    return [next(loader) for _ in range(n)]


def test_windows_are_the_token_stream_with_bos_eos(tmp_path):
    rows = docs(6)
    cfg = DataSection(path=jsonl(tmp_path / "a.jsonl", rows))
    stream = [t for r in rows for t in TOK.encode(r["text"], bos=True, eos=True)]
    ds = iter(TextDataset(cfg, TOK, seq_len=16))
    for k in range(len(stream) // 16 - 1):
        sample = next(ds)
        assert sample["input"].tolist() == stream[16 * k : 16 * k + 16]
        assert sample["label"].tolist() == stream[16 * k + 1 : 16 * k + 17]


def test_loops_over_epochs(tmp_path):
    cfg = DataSection(path=jsonl(tmp_path / "a.jsonl", docs(2)))
    ds = TextDataset(cfg, TOK, seq_len=32)
    take(iter(ds), 10)
    assert ds.epoch >= 1


def _one_pass(ds: TextDataset) -> list[int]:
    """The document numbers a dataset's rank reads in its first epoch."""
    texts, seen = ds._documents(), []
    while True:
        text = next(texts)
        if ds.epoch:
            return seen
        seen.append(int(text.strip("<>")))


def test_dp_ranks_read_disjoint_byte_ranges_covering_all(tmp_path):
    """Each rank reads a contiguous stretch of the file (one byte range per rank); together, every row once."""
    rows = [{"text": f"<{i}>"} for i in range(12)]
    cfg = DataSection(path=jsonl(tmp_path / "a.jsonl", rows))
    seen = [_one_pass(TextDataset(cfg, TOK, seq_len=4, dp_rank=rank, dp_world=3)) for rank in range(3)]
    assert sum(seen, []) == list(range(12))
    assert all(3 <= len(s) <= 5 for s in seen)  # ranges of equal bytes; rows 10 and 11 are one byte longer


def test_fixed_shards_give_the_same_rows_per_step_at_any_dp_degree(tmp_path):
    """--data.shards 4: one process reads the 4 ranges in turn; 2 ranks read 2 each, the same rows per step."""
    rows = [{"text": f"<{i:02d}>"} for i in range(16)]  # equal lines: 4 per range
    cfg = DataSection(path=jsonl(tmp_path / "a.jsonl", rows), shards=4)
    single = _one_pass(TextDataset(cfg, TOK, seq_len=4))
    assert single == [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15]
    ranks = [_one_pass(TextDataset(cfg, TOK, seq_len=4, dp_rank=r, dp_world=2)) for r in range(2)]
    assert ranks == [[0, 8, 1, 9, 2, 10, 3, 11], [4, 12, 5, 13, 6, 14, 7, 15]]
    for step in range(4):  # 2 rows per rank per step = 4 rows of one process
        assert sorted(ranks[0][2 * step : 2 * step + 2] + ranks[1][2 * step : 2 * step + 2]) == sorted(
            single[4 * step : 4 * step + 4]
        )
    with pytest.raises(DataError, match="--data.shards 4 must be a multiple of the data-parallel degree 3"):
        TextDataset(cfg, TOK, seq_len=4, dp_rank=0, dp_world=3)


def test_more_ranks_than_rows_leaves_a_rank_without_data(tmp_path):
    cfg = DataSection(path=jsonl(tmp_path / "a.jsonl", [{"text": "one long document " * 20}, {"text": "b"}]))
    with pytest.raises(DataError, match="a whole pass gave data-parallel rank 1 of 4 nothing to train on"):
        next(iter(TextDataset(cfg, TOK, seq_len=4, dp_rank=1, dp_world=4)))


@pytest.mark.parametrize("dp_world", [1, 2])
def test_resume_gives_the_same_next_batches(tmp_path, dp_world):
    files = [jsonl(tmp_path / f"{i}.jsonl", docs(7 + i)) for i in range(2)]
    cfg = DataSection(path=str(tmp_path))
    assert len(files) == 2
    for rank in range(dp_world):
        ref = BatchLoader(TextDataset(cfg, TOK, seq_len=24, dp_rank=rank, dp_world=dp_world), batch_size=3)
        take(ref, 5)
        state = json.loads(json.dumps(ref.state_dict()))  # checkpoints hold plain data
        expected = take(ref, 6)  # crosses files and an epoch boundary
        resumed = BatchLoader(TextDataset(cfg, TOK, seq_len=24, dp_rank=rank, dp_world=dp_world), batch_size=3)
        resumed.load_state_dict(state)
        for a, b in zip(expected, take(resumed, 6)):
            assert torch.equal(a["input"], b["input"]) and torch.equal(a["label"], b["label"])


def test_resume_with_other_files_is_refused(tmp_path):
    a = TextDataset(DataSection(path=jsonl(tmp_path / "a.jsonl", docs(3))), TOK, seq_len=8)
    b = TextDataset(DataSection(path=jsonl(tmp_path / "b.jsonl", docs(3))), TOK, seq_len=8)
    with pytest.raises(DataError, match="other files"):
        b.load_state_dict(a.state_dict())


def test_bad_rows_are_skipped_and_counted(tmp_path, caplog):
    rows = [{"text": "good one"}, {"body": "no text key"}, {"text": 42}, {"text": "good two"}]
    path = jsonl(tmp_path / "bad.jsonl", rows)
    ds = TextDataset(DataSection(path=path, on_bad_row="skip"), TOK, seq_len=4)
    assert list(_first(ds._documents(), 2)) == ["good one", "good two"]
    assert ds.bad_rows == 2
    assert f"--data.path {path}: row 1: no 'text' column (columns: ['body'])" in caplog.text
    assert f"--data.path {path}: row 2: 'text' is int, not a string" in caplog.text


def test_bad_rows_fail_when_asked(tmp_path):
    path = jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}, {"text": None}])
    ds = TextDataset(DataSection(path=path, on_bad_row="fail"), TOK, seq_len=4)
    with pytest.raises(DataError, match=rf"--data.path {path}: row 1: 'text' is missing or null; "):
        list(_first(ds._documents(), 2))


def test_unreadable_file_names_the_file(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 this is not parquet")
    ds = TextDataset(DataSection(path=str(path)), TOK, seq_len=4)
    with pytest.raises(DataError, match=f"--data.path {path}: cannot open"):
        list(_first(ds._documents(), 2))


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.json", "empty.txt", "empty.parquet"])
def test_an_empty_file_is_named_as_empty(tmp_path, name):
    (tmp_path / name).write_bytes(b"" if name != "empty.json" else b"  \n\n")
    with pytest.raises(DataError, match=f"--data.path {tmp_path / name}: the file is empty"):
        TextDataset(DataSection(path=str(tmp_path / name)), TOK, seq_len=4)


def _lines_with_bad_ones(path: Path, n: int, bad: dict[int, bytes]) -> list[str]:
    """n rows, the ones in `bad` replaced by broken lines; returns the texts of the good rows."""
    lines = [bad.get(i, json.dumps({"text": f"doc {i}"}).encode()) for i in range(n)]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return [f"doc {i}" for i in range(n) if i not in bad]


BROKEN = {1: b'{"text": oops', 2: b'{"text": "caf\xe9"}', 2345: b'{"text": "unterminated'}


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_line_that_is_not_json_or_not_utf8_is_a_bad_row(tmp_path, suffix, caplog):
    path = tmp_path / f"data{suffix}"
    good = _lines_with_bad_ones(path, 3000, BROKEN)
    ds = TextDataset(DataSection(path=str(path)), TOK, seq_len=4)
    assert list(_first(ds._documents(), len(good))) == good
    assert ds.bad_rows == 3
    assert f"--data.path {path}: row 1: not valid JSON" in caplog.text
    assert f"--data.path {path}: row 2: not UTF-8 text" in caplog.text
    assert f"--data.path {path}: row 2345: not valid JSON" in caplog.text
    ds = TextDataset(DataSection(path=str(path), on_bad_row="fail"), TOK, seq_len=4)
    with pytest.raises(DataError, match=rf"--data.path {path}: row 1: not valid JSON .*; fix or delete the line"):
        list(_first(ds._documents(), 2))


def test_txt_lines_that_are_not_utf8_are_bad_rows(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"line one\r\nbad \xff line\n\nline three")
    ds = TextDataset(DataSection(path=str(path)), TOK, seq_len=4)
    assert list(_first(ds._documents(), 3)) == ["line one", "", "line three"]  # a blank line is an empty document
    assert ds.bad_rows == 1


def test_blank_lines_keep_row_numbers_equal_to_line_numbers(tmp_path, caplog):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "a"}\n\n   \n{"body": "b"}\n{"text": "c"}\n')
    ds = TextDataset(DataSection(path=str(path)), TOK, seq_len=4)
    assert list(_first(ds._documents(), 2)) == ["a", "c"]
    assert ds.bad_rows == 1 and f"--data.path {path}: row 3: no 'text' column" in caplog.text


@pytest.mark.parametrize("dp_world", [1, 2])
def test_resume_is_exact_across_bad_lines(tmp_path, dp_world):
    _lines_with_bad_ones(tmp_path / "a.jsonl", 40, {3: b"{", 4: b"\xff", 17: b"[1,", 30: b"nope"})
    cfg = DataSection(path=str(tmp_path / "a.jsonl"))
    for rank in range(dp_world):
        ref = BatchLoader(TextDataset(cfg, TOK, seq_len=8, dp_rank=rank, dp_world=dp_world), batch_size=2)
        take(ref, 3)
        state = json.loads(json.dumps(ref.state_dict()))
        expected = take(ref, 12)  # crosses the bad lines and an epoch boundary
        resumed = BatchLoader(TextDataset(cfg, TOK, seq_len=8, dp_rank=rank, dp_world=dp_world), batch_size=2)
        resumed.load_state_dict(state)
        for a, b in zip(expected, take(resumed, 12)):
            assert torch.equal(a["input"], b["input"])
        assert resumed.dataset.bad_rows == ref.dataset.bad_rows


def test_txt_and_parquet_sources(tmp_path):
    (tmp_path / "a.txt").write_text("line one\nline two\n")
    import datasets

    datasets.Dataset.from_list([{"text": "from parquet"}]).to_parquet(str(tmp_path / "b.parquet"))
    ds = TextDataset(DataSection(path=str(tmp_path)), TOK, seq_len=4)
    assert list(_first(ds._documents(), 3)) == ["line one", "line two", "from parquet"]


def _first(it, n):
    for _ in range(n):
        yield next(it)


def test_synthetic_is_reproducible_and_resumable():
    ref = BatchLoader(SyntheticDataset(vocab_size=100, seq_len=8, seed=3), batch_size=2)
    take(ref, 2)
    state = ref.state_dict()
    expected = take(ref, 2)
    resumed = BatchLoader(SyntheticDataset(vocab_size=100, seq_len=8, seed=3), batch_size=2)
    resumed.load_state_dict(state)
    assert all(torch.equal(a["input"], b["input"]) for a, b in zip(expected, take(resumed, 2)))
    assert int(expected[0]["input"].max()) < 100


def test_synthetic_global_batch_is_layout_invariant():
    """Two DP ranks with batch 2 see exactly the windows one process sees with batch 4."""
    single = next(BatchLoader(SyntheticDataset(100, 8, seed=5), batch_size=4))["input"]
    ranks = [
        next(BatchLoader(SyntheticDataset(100, 8, seed=5, dp_rank=r, dp_world=2), batch_size=2))["input"]
        for r in (0, 1)
    ]
    union = sorted(map(tuple, torch.cat(ranks).tolist()))
    assert union == sorted(map(tuple, single.tolist()))
    assert not torch.equal(ranks[0], ranks[1])


def test_a_streamed_parquet_file_resumes_from_its_own_state(tmp_path, monkeypatch):
    """Sources read through `datasets` resume from the stream's own state_dict (the library passes over whole
    shards and record batches without making rows of them): the same batches, no earlier row handed to us."""
    import datasets

    import titanium.data.text as text

    datasets.Dataset.from_list(docs(300)).to_parquet(str(tmp_path / "a.parquet"), batch_size=50)
    cfg = DataSection(path=str(tmp_path / "a.parquet"))
    read: list[int] = []

    def counting(source, ds, first_row):
        for row, item in text_read_stream(source, ds, first_row):
            read.append(row)
            yield row, item

    text_read_stream = text.read_stream
    monkeypatch.setattr(text, "read_stream", counting)
    ref = BatchLoader(TextDataset(cfg, TOK, seq_len=24, dp_rank=1, dp_world=2), batch_size=3)
    take(ref, 10)
    state = json.loads(json.dumps(ref.state_dict()))
    read.clear()
    expected = take(ref, 10)
    read_after_state = list(read)
    resumed = BatchLoader(TextDataset(cfg, TOK, seq_len=24, dp_rank=1, dp_world=2), batch_size=3)
    resumed.load_state_dict(state)
    read.clear()
    for a, b in zip(expected, take(resumed, 10)):
        assert torch.equal(a["input"], b["input"])
    assert read == read_after_state and read[0] > 50  # the rows after the position, and only those


def test_prefetch_hands_on_the_readers_error_at_its_batch(tmp_path):
    """A bad row met in the prefetch thread stops the run with the same error, after the good batches."""
    path = jsonl(tmp_path / "a.jsonl", [{"text": "x" * 15}, {"text": None}])
    loader = BatchLoader(TextDataset(DataSection(path=path, on_bad_row="fail"), TOK, seq_len=8), 2, prefetch=3)
    first = next(loader)  # 17 tokens: two windows of 8 (+1) before the bad row
    assert first["input"].shape == (2, 8)
    for _ in range(2):  # and again on a later call: the loader does not hang
        with pytest.raises(DataError, match=rf"--data.path {path}: row 1: 'text' is missing or null"):
            next(loader)
    loader.close()


@pytest.mark.cuda  # pinned memory needs CUDA
def test_prefetched_batches_are_pinned_on_cuda(tmp_path):
    cfg = DataSection(path=jsonl(tmp_path / "a.jsonl", docs(20)))
    loader = BatchLoader(TextDataset(cfg, TOK, seq_len=8), 2, prefetch=2, pin_memory=True)
    batch = next(loader)
    assert all(v.is_pinned() for v in batch.values())
    on_gpu = {k: v.to("cuda", non_blocking=True) for k, v in batch.items()}
    torch.cuda.synchronize()
    assert torch.equal(on_gpu["input"].cpu(), batch["input"])
    loader.close()


@pytest.mark.parametrize("dp_world", [1, 2])
def test_a_json_array_is_read_row_for_row_and_resumes_exactly(tmp_path, dp_world):
    """A ``.json`` array file whose rows differ in a column's type (a message content that is a string in one row and
    a list of content parts in another, TRL's image rows): each row is the JSON value it is in the file (read by
    ``datasets``, both came back as JSON text: ``'"hi"'``), and a resumed reader goes on where the saved one was."""
    from titanium.data.text import open_stream, read_stream, resolve_sources

    rows = [{"text": f"doc {i}", "extra": "plain" if i % 2 else [{"type": "image"}, 1.5]} for i in range(30)]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows, indent=1))
    source = resolve_sources(DataSection(path=str(path)))[0]
    assert [item for _, item in read_stream(source, open_stream(source), 0)] == rows
    cfg = DataSection(path=str(path))
    for rank in range(dp_world):
        ref = BatchLoader(TextDataset(cfg, TOK, seq_len=8, dp_rank=rank, dp_world=dp_world), batch_size=2)
        take(ref, 3)
        state = json.loads(json.dumps(ref.state_dict()))
        expected = take(ref, 12)  # (crosses an epoch boundary)
        resumed = BatchLoader(TextDataset(cfg, TOK, seq_len=8, dp_rank=rank, dp_world=dp_world), batch_size=2)
        resumed.load_state_dict(state)
        for a, b in zip(expected, take(resumed, 12)):
            assert torch.equal(a["input"], b["input"])
    path.write_text('{"text": "one object, not an array"')
    with pytest.raises(DataError, match=rf"--data.path {path}: cannot read it: not a JSON array"):
        list(read_stream(source, open_stream(source), 0))
