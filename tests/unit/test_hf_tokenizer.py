"""Hugging Face tokenizer.json loader: byte-level BPE, special tokens, BOS/EOS rules."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from titanium.config.sections import TokenizerSection
from titanium.data.tokenizer import HFTokenizer, Tokenizer, TokenizerError, build_tokenizer

tokenizers = pytest.importorskip("tokenizers")

TEXTS = ["Hello, world!", "naïve café 中文 🚀", "  spaces\tand\nnewlines  ", "", "code: x = {'a': [1, 2]}"]
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokenizer", *TEXTS] * 20


def _make(folder: Path, config: dict | None, specials: list[str]) -> Path:
    """A small Qwen-style byte-level BPE tokenizer.json (trained here), plus tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(specials)
    tok.add_tokens(["<think>"])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_qwen_style_no_bos(tmp_path: Path) -> None:
    path = _make(tmp_path, {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, QWEN_SPECIALS)
    tok = build_tokenizer(TokenizerSection(kind="hf", path=str(path)))
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert tok.bos_id is None
    assert tok.eos_id == tok.special_tokens["<|im_end|>"] and tok.pad_id == tok.special_tokens["<|endoftext|>"]
    assert "<think>" in tok.special_tokens and tok.vocab_size == max(tok.special_tokens.values()) + 1
    for text in TEXTS:
        ids = tok.encode(text, bos=True, eos=True)
        assert ids[-1] == tok.eos_id and tok.eos_id not in ids[:-1]
        assert tok.decode(ids[:-1]) == text
        assert tok.encode(text, bos=False, eos=False) == ids[:-1]  # bos=True adds nothing without a BOS


def test_special_strings_in_text_stay_text(tmp_path: Path) -> None:
    tok = HFTokenizer(str(_make(tmp_path, {"bos_token": None, "eos_token": "<|im_end|>"}, QWEN_SPECIALS)))
    ids = tok.encode("a <|im_end|> b <|im_start|>", bos=False, eos=False)
    assert not set(ids) & {tok.special_tokens["<|im_end|>"], tok.special_tokens["<|im_start|>"]}
    assert tok.decode(ids) == "a <|im_end|> b <|im_start|>"
    # Non-special added tokens (Qwen's <think>) are ordinary vocabulary and do match.
    assert tok.special_tokens["<think>"] in tok.encode("<think>x", bos=False, eos=False)
    assert tok.decode([tok.special_tokens["<|im_start|>"]]) == "<|im_start|>"


def test_names_without_config_and_llama_style_bos(tmp_path: Path) -> None:
    tok = HFTokenizer(str(_make(tmp_path / "qwen", None, QWEN_SPECIALS)))
    assert tok.bos_id is None and tok.eos_id == tok.pad_id == tok.special_tokens["<|endoftext|>"]
    llama = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    config = {"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|eot_id|>"}
    tok = HFTokenizer(str(_make(tmp_path / "llama", config, llama)))
    assert tok.bos_id == tok.special_tokens["<|begin_of_text|>"] and tok.eos_id == tok.special_tokens["<|eot_id|>"]
    ids = tok.encode("hi", bos=True, eos=False)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="not found"):
        HFTokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a Hugging Face tokenizer.json"):
        HFTokenizer(str(tmp_path / "tokenizer.json"))
    path = _make(tmp_path / "noeos", None, ["<|im_start|>"])
    with pytest.raises(TokenizerError, match="cannot tell the eos_token"):
        HFTokenizer(str(path))
    path = _make(tmp_path / "badcfg", {"eos_token": "<|nope|>"}, QWEN_SPECIALS)
    with pytest.raises(
        TokenizerError, match=re.escape("eos_token '<|nope|>' of tokenizer_config.json is not in the vocab")
    ):
        HFTokenizer(str(path))
