"""What a job's inputs say (titanium/inputs.py): a Hugging Face start folder gives the family and the tokenizer, a
flag that disagrees with it is refused naming both, a tokenizer that does not fit the embedding is refused (the
silent wrong-tokenizer run of issue 42), and --data.kind auto reads the kind from the dataset's columns."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.tokenizer_families import family_tokenizer
from titanium.checkpoint.hf import HFCheckpointError, check_tokenizer_fits
from titanium.config import ConfigError
from titanium.data.kinds import detect_kind
from titanium.data.text import DataError
from titanium.inputs import load_job

DEBUG_TOKENIZER = str(REPO / "assets/tokenizer/titanium_debug.tiktoken")


def _jsonl(path: Path, *rows: dict) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


CHAT = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}


@pytest.fixture
def qwen_folder(tmp_path) -> Path:
    return family_tokenizer("qwen2", tmp_path / "qwen")


def _job(tmp_path: Path, folder: Path, *extra: str):
    data = _jsonl(tmp_path / "chat.jsonl", CHAT)
    return load_job(
        [
            "--training.objective", "sft", "--data.path", data, "--job.dump_folder", str(tmp_path / "out"),
            "--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf", *extra,
        ]
    )  # fmt: skip


def test_the_folder_gives_family_tokenizer_and_data_kind(tmp_path, qwen_folder, caplog):
    with caplog.at_level(logging.INFO, logger="titanium"):
        cfg = _job(tmp_path, qwen_folder)
    assert cfg.model.name == "qwen2"
    assert (cfg.tokenizer.kind, cfg.tokenizer.path) == ("hf", str(qwen_folder))
    assert cfg.data.kind == "chat"
    said = caplog.text
    assert f"from {qwen_folder}: model qwen2" in said and "--data.kind auto: chat (the 'messages' column" in said


def test_flags_that_disagree_with_the_folder_are_refused(tmp_path, qwen_folder):
    with pytest.raises(ConfigError, match=r"--model.name llama3 disagrees with .*config.json \(model_type 'qwen2'"):
        _job(tmp_path, qwen_folder, "--model.name", "llama3")
    with pytest.raises(ConfigError, match=r"--tokenizer.kind tiktoken --tokenizer.path .*titanium_debug.tiktoken "):
        _job(tmp_path, qwen_folder, "--tokenizer.kind", "tiktoken", "--tokenizer.path", DEBUG_TOKENIZER)
    # Flags naming the folder's own tokenizer (or one with the same ids) are fine.
    cfg = _job(tmp_path, qwen_folder, "--tokenizer.kind", "hf", "--tokenizer.path", str(qwen_folder / "tokenizer.json"))
    assert cfg.tokenizer.path == str(qwen_folder / "tokenizer.json")
    copy = family_tokenizer("qwen2", tmp_path / "copy")
    assert _job(tmp_path, qwen_folder, "--tokenizer.kind", "hf", "--tokenizer.path", str(copy)).model.name == "qwen2"


def test_a_tokenizer_must_fit_the_embedding(tmp_path):
    folder = tmp_path / "weights_only"
    folder.mkdir()
    # The run: the debug tokenizer (2,256 ids) on a 4,096-row embedding is refused, not noted.
    with pytest.raises(HFCheckpointError, match="1840 rows more than ids is not padding.*has no tokenizer files"):
        check_tokenizer_fits(2256, 4096, folder, DEBUG_TOKENIZER)
    with pytest.raises(HFCheckpointError, match="ids past the embedding table"):
        check_tokenizer_fits(5000, 4096, folder, DEBUG_TOKENIZER)
    check_tokenizer_fits(151_665, 151_936, folder, "elsewhere")  # padding (Qwen2.5)
    check_tokenizer_fits(2256, 2256, folder, DEBUG_TOKENIZER)
    check_tokenizer_fits(100_002, 102_400, folder, str(folder))  # a folder's own tokenizer may be padded more
    check_tokenizer_fits(100_002, 102_400, folder, str(folder / "tokenizer.json"))


@pytest.mark.parametrize(
    ("row", "kind", "why"),
    [
        (CHAT, "chat", "'messages'"),
        ({"prompt": "p", "completion": "c"}, "chat", "'prompt' and 'completion'"),
        ({"prompt": [{"role": "user", "content": "p"}]}, "chat", "'prompt'"),
        ({"prompt": "p", "chosen": "c", "rejected": "r"}, "preference", "'chosen' and 'rejected'"),
        ({"prompt": "p", "completion": "c", "label": True}, "unpaired", "'completion' and 'label'"),
        ({"instruction": "i", "input": "", "output": "o"}, "instruct", "'instruction' and 'output'"),
        ({"text": "t"}, "text", "'text'"),
    ],
)
def test_data_kind_from_columns(tmp_path, row, kind, why):
    from titanium.config.sections import DataSection

    data = DataSection(path=_jsonl(tmp_path / "d.jsonl", row))
    assert detect_kind(data, "sft") == (kind, f"the {why} column{'s' * (' and ' in why)} of {data.path}")
    assert detect_kind(data, "pretrain")[0] == "text"


def test_data_kind_auto_refuses_unknown_columns(tmp_path):
    from titanium.config.sections import DataSection

    data = DataSection(path=_jsonl(tmp_path / "d.jsonl", {"question": "q", "response": "r"}))
    with pytest.raises(DataError, match=r"cannot tell what .*d.jsonl holds from its columns \(question, response\)"):
        detect_kind(data, "sft")


def test_grpo_prompts_without_answers(tmp_path):
    prompts = _jsonl(tmp_path / "prompts.jsonl", {"prompt": [{"role": "user", "content": "Say hi"}]})
    cfg = load_job(
        [
            "--training.objective", "grpo", "--data.path", prompts, "--job.dump_folder", str(tmp_path / "out"),
            "--training.local_batch_size", "8", "--training.seq_len", "1024",
        ]
    )  # fmt: skip
    assert cfg.data.kind == "chat" and cfg.rl.answer_column == ""


def test_a_start_up_line_says_what_strings_mean(tmp_path, caplog):
    """TRL reads strings as plain text everywhere; titanium keeps the chat format for preference and prompt strings
    (its preference and RL data follow a chat model's SFT) and says so at start-up, with the way to TRL's rule."""
    from titanium.config.sections import DataSection
    from titanium.data.kinds import string_rule

    pairs = DataSection(
        kind="preference", path=_jsonl(tmp_path / "p.jsonl", {"prompt": "p", "chosen": "c", "rejected": "r"})
    )
    assert "--chat.chat_template none does so here" in string_rule(pairs, "dpo", "auto")
    assert string_rule(pairs, "dpo", "none") == "string rows are plain text, as in TRL"
    completions = DataSection(kind="chat", path=_jsonl(tmp_path / "c.jsonl", {"prompt": "p", "completion": "c"}))
    assert string_rule(completions, "sft", "auto").startswith("string prompt/completion rows are plain text")
    prompts = DataSection(kind="chat", path=_jsonl(tmp_path / "g.jsonl", {"prompt": "p"}))
    assert "--data.kind text --data.text_column prompt" in string_rule(prompts, "grpo", "auto")
    assert string_rule(DataSection(kind="chat", path=_jsonl(tmp_path / "m.jsonl", CHAT)), "sft", "auto") is None
