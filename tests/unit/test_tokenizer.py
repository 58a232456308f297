"""Tokenizer tests: round trips, BOS/EOS, specials as text, the bundled file, bad files."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import pytest

from titanium.config.sections import TokenizerSection
from titanium.data.tokenizer import (
    LLAMA3_SPECIAL_TOKENS,
    ByteTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    TokenizerError,
    build_tokenizer,
    decode_sampled,
    load_bpe_ranks,
)

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "assets/tokenizer/titanium_debug.tiktoken"
CORPUS = REPO / "assets/corpus"

EDGE_CASES = [
    "",
    " ",
    "a",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\r\nand\n\n\nmore",
    "\n\n\n",
    "naïve café, Zürich, Ærøskøbing, façade",
    "Ελληνικά, русский, 中文, 日本語, 한국어, עברית, العربية",
    "emoji 🚀🔥 family 👨‍👩‍👧‍👦 flags 🇫🇷 skin 👍🏽",
    "zero\u200bwidth\u00a0nbsp\ufeffbom",
    "numbers 1234567890 3.14159 1,000,000 -42",
    "code: def f(x):\n    return {'a': [1, 2]}  # comment",
    "x" * 30_000 + " " * 30_000 + "y",
    "\x00\x01\x7f control chars",
]


@pytest.fixture(scope="module")
def tok() -> TiktokenTokenizer:
    return TiktokenTokenizer(str(BUNDLED))


@pytest.fixture(scope="module")
def corpus_texts() -> list[str]:
    with open(CORPUS / "validation.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def test_bundled_vocab_and_ids(tok: TiktokenTokenizer) -> None:
    assert tok.vocab_size == 2256
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (2000, 2001, 2004)
    assert len(tok.special_tokens) == 256
    assert tok.special_tokens["<|start_header_id|>"] == 2006
    assert tok.special_tokens["<|end_header_id|>"] == 2007
    assert tok.special_tokens["<|eot_id|>"] == 2009
    assert tok.special_tokens["<|python_tag|>"] == 2010
    assert tok.special_tokens["<|reserved_special_token_246|>"] == 2255
    assert isinstance(tok, Tokenizer)


def test_special_token_order_matches_llama3() -> None:
    assert len(LLAMA3_SPECIAL_TOKENS) == len(set(LLAMA3_SPECIAL_TOKENS)) == 256
    assert LLAMA3_SPECIAL_TOKENS[:11] == (
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|step_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    )
    assert LLAMA3_SPECIAL_TOKENS[11] == "<|reserved_special_token_2|>"


@pytest.mark.parametrize("text", EDGE_CASES)
def test_round_trip_edge_cases(tok: TiktokenTokenizer, text: str) -> None:
    ids = tok.encode(text, bos=False, eos=False)
    assert all(0 <= i < 2000 for i in ids)
    assert tok.decode(ids) == text


def test_round_trip_corpus(tok: TiktokenTokenizer, corpus_texts: list[str]) -> None:
    for text in corpus_texts:
        assert tok.decode(tok.encode(text, bos=False, eos=False)) == text


def test_long_text_is_fast_and_exact(tok: TiktokenTokenizer, corpus_texts: list[str]) -> None:
    text = "\n\n".join(corpus_texts) * 3  # ~0.5 MB, above the 400k-char piece size
    start = time.perf_counter()
    ids = tok.encode(text, bos=False, eos=False)
    assert time.perf_counter() - start < 5.0
    assert tok.decode(ids) == text


@pytest.mark.parametrize("bos", [False, True])
@pytest.mark.parametrize("eos", [False, True])
@pytest.mark.parametrize("make", [lambda: TiktokenTokenizer(str(BUNDLED)), ByteTokenizer])
def test_bos_eos_placement(make, bos: bool, eos: bool) -> None:
    t = make()
    plain = t.encode("Call me Ishmael.", bos=False, eos=False)
    ids = t.encode("Call me Ishmael.", bos=bos, eos=eos)
    assert ids == [t.bos_id] * bos + plain + [t.eos_id] * eos
    assert t.bos_id not in plain and t.eos_id not in plain
    empty = t.encode("", bos=bos, eos=eos)
    assert empty == [t.bos_id] * bos + [t.eos_id] * eos


@pytest.mark.parametrize("make", [lambda: TiktokenTokenizer(str(BUNDLED)), ByteTokenizer])
def test_special_strings_in_text_stay_text(make) -> None:
    t = make()
    text = "<|begin_of_text|>hi<|eot_id|><|start_header_id|>user<|end_header_id|><|end_of_text|>"
    ids = t.encode(text, bos=False, eos=False)
    assert not set(ids) & set(t.special_tokens.values())
    assert t.decode(ids) == text
    # Specials added by id decode to their strings.
    sid = t.special_tokens["<|eot_id|>"]
    assert t.decode([sid]) == "<|eot_id|>"
    assert t.decode(t.encode("a", bos=True, eos=True)) == "<|begin_of_text|>a<|end_of_text|>"


def test_decode_accepts_tensors(tok: TiktokenTokenizer) -> None:
    import torch

    ids = tok.encode("tensor ids", bos=True, eos=False)
    assert tok.decode(torch.tensor(ids)) == "<|begin_of_text|>tensor ids"
    assert ByteTokenizer().decode(torch.tensor([104, 105])) == "hi"


def test_decode_out_of_range(tok: TiktokenTokenizer) -> None:
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="out of range"):
        ByteTokenizer().decode([512])


def test_sampled_ids_past_the_tokenizer_are_left_out_as_transformers_does(tok: TiktokenTokenizer) -> None:
    ids = tok.encode("hi there", bos=False, eos=False)
    assert decode_sampled(tok, [tok.vocab_size, *ids, tok.vocab_size + 5]) == "hi there"


def test_compresses_corpus(tok: TiktokenTokenizer, corpus_texts: list[str]) -> None:
    n_bytes = sum(len(t.encode("utf-8")) for t in corpus_texts)
    n_tokens = sum(len(tok.encode(t, bos=False, eos=False)) for t in corpus_texts)
    # Measured 0.315 tokens/byte on the validation split; bytes alone would be 1.0.
    assert n_tokens / n_bytes < 0.36


def test_byte_tokenizer() -> None:
    t = ByteTokenizer()
    assert t.vocab_size == 512
    assert (t.bos_id, t.eos_id, t.pad_id) == (256, 257, 260)
    assert t.special_tokens["<|eot_id|>"] == 265
    assert t.encode("Aé", bos=False, eos=False) == [65, 0xC3, 0xA9]
    for text in EDGE_CASES:
        assert t.decode(t.encode(text, bos=False, eos=False)) == text
    assert t.decode([0xC3]) == "\ufffd"  # a truncated UTF-8 sequence does not raise


def test_build_tokenizer() -> None:
    assert isinstance(build_tokenizer(TokenizerSection(kind="byte")), ByteTokenizer)
    t = build_tokenizer(TokenizerSection(kind="tiktoken", path=str(BUNDLED)))
    assert isinstance(t, TiktokenTokenizer) and t.vocab_size == 2256
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        build_tokenizer(TokenizerSection(kind="nope"))  # type: ignore[arg-type]


def _write_ranks(path: Path) -> list[str]:
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    path.write_text("\n".join(lines) + "\n")
    return lines


def test_minimal_file_loads(tmp_path: Path) -> None:
    p = tmp_path / "bytes.tiktoken"
    _write_ranks(p)
    t = TiktokenTokenizer(str(p))
    assert (t.vocab_size, t.bos_id) == (512, 256)
    assert t.decode(t.encode("héllo", bos=False, eos=False)) == "héllo"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="nothing.tiktoken"):
        TiktokenTokenizer(str(tmp_path / "nothing.tiktoken"))
    with pytest.raises(TokenizerError, match="scripts/train_tokenizer.py"):
        TiktokenTokenizer(str(tmp_path / "titanium_debug.tiktoken"))


@pytest.mark.parametrize(
    "bad_line",
    ["not-base64!! 300", "QUJD", "QUJD notanumber", "QUJD 300 extra", "QUJD -1"],
)
def test_malformed_line_reports_line_number(tmp_path: Path, bad_line: str) -> None:
    p = tmp_path / "bad.tiktoken"
    lines = _write_ranks(p)
    lines.insert(10, bad_line)
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"bad\.tiktoken:11: "):
        TiktokenTokenizer(str(p))


def test_corrupt_files(tmp_path: Path) -> None:
    p = tmp_path / "x.tiktoken"
    p.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_bpe_ranks(str(p))
    p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00binary")
    with pytest.raises(ValueError, match=r"x\.tiktoken:1: "):
        load_bpe_ranks(str(p))
    lines = _write_ranks(p)
    p.write_text("\n".join(lines[:-1]) + "\n")  # byte 255 missing
    with pytest.raises(ValueError, match="single-byte"):
        load_bpe_ranks(str(p))
    p.write_text("\n".join(lines + [f"{base64.b64encode(b'ab').decode()} 300"]) + "\n")  # gap
    with pytest.raises(ValueError, match="gaps"):
        load_bpe_ranks(str(p))
    p.write_text("\n".join(lines + [f"{base64.b64encode(b'a').decode()} 256"]) + "\n")  # dup
    with pytest.raises(ValueError, match="duplicate"):
        load_bpe_ranks(str(p))
