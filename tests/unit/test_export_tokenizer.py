"""Every export folder carries the run's tokenizer and chat template as transformers' AutoTokenizer loads them
(titanium/data/export.py): ids and chat renderings equal titanium's; reward-model metrics are named usefully."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.tokenizer_families import family_tokenizer
from titanium.data.chat import Message, build_chat_template
from titanium.data.export import save_tokenizer
from titanium.data.tokenizer import DEFAULT_TOKENIZER_PATH, HFTokenizer, TiktokenTokenizer
from titanium.models import default_chat_format
from titanium.rl.rewards.functions import reward_labels

transformers = pytest.importorskip("transformers")

TEXTS = ["Hello, world! 2024 and 19", "naïve café 中文 🚀", "  spaces\tand\nnewlines  ", *(str(i) for i in range(200))]
CHAT = [Message("system", "Be brief."), Message("user", "What is 12 + 7?"), Message("assistant", "It is 19.")]


def _same_as_autotokenizer(out: Path, tokenizer, template_name: str, family: str) -> None:
    auto = transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert auto.encode(text, add_special_tokens=False) == tokenizer.encode(text, bos=False, eos=False), text
    assert (auto.bos_token_id, auto.eos_token_id) == (tokenizer.bos_id, tokenizer.eos_id)
    template = build_chat_template(template_name, tokenizer, default_chat_format(family))
    dicts = [m.as_dict() for m in CHAT]
    tokens, _ = template.tokenize(CHAT, train_on_input=False)
    assert auto.apply_chat_template(dicts, tokenize=True, return_dict=False) == tokens
    prompt = auto.apply_chat_template(dicts[:-1], tokenize=True, add_generation_prompt=True, return_dict=False)
    assert prompt == template.prompt(CHAT[:-1])


def test_the_debug_tokenizer_is_exported_as_a_hugging_face_one(tmp_path):
    tokenizer = TiktokenTokenizer(str(REPO / DEFAULT_TOKENIZER_PATH))
    written = save_tokenizer(tmp_path, tokenizer, "auto", default_chat_format("llama3"))
    assert written == ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    _same_as_autotokenizer(tmp_path, tokenizer, "auto", "llama3")


@pytest.mark.parametrize(("family", "template"), [("qwen2", "auto"), ("qwen2", "chatml"), ("qwen3", "qwen3")])
def test_a_folders_tokenizer_and_the_format_trained_on(tmp_path, family, template):
    tokenizer = HFTokenizer(str(family_tokenizer(family, tmp_path / "source")))
    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text((tmp_path / "source/config.json").read_text())  # (an export has its config)
    written = save_tokenizer(out, tokenizer, template, default_chat_format(family))
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(written)
    assert ("chat_template.jinja" in written) == (template != "auto")  # (a built-in format, not the tokenizer's)
    _same_as_autotokenizer(out, tokenizer, template, family)


def test_reward_metrics_are_named_after_something_meaningful(tmp_path):
    run = tmp_path / "rm_run" / "hf"
    run.mkdir(parents=True)
    (tmp_path / "scorer").mkdir()
    names = [str(run), str(tmp_path / "scorer"), "exact_match", "rewards.py:length_reward", "pkg.mod:length_reward"]
    assert reward_labels(names) == {
        str(run): "rm_run-hf",
        str(tmp_path / "scorer"): "scorer",
        "exact_match": "exact_match",
        "rewards.py:length_reward": "rewards.py:length_reward",  # (two functions of one name keep their spelling)
        "pkg.mod:length_reward": "pkg.mod:length_reward",
    }
    assert reward_labels(["rewards.py:length_reward"]) == {"rewards.py:length_reward": "length_reward"}
