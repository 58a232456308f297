"""titanium's ids for a Hugging Face tokenizer folder are transformers' ``AutoTokenizer.from_pretrained(folder)``'s, for
every family's published tokenizer shape (tests/tokenizer_families.py): numbers, whitespace runs, unicode, special
tokens, and the chat template's output. transformers 5 rebuilds some tokenizers with a pipeline of its own
(``Qwen2Tokenizer`` splits digits one by one whatever tokenizer.json says), so running tokenizer.json alone is not
enough: ``qwen2_plain`` is the folder of issue 42, where it gave other ids for 48 of the numbers 0-999."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.tokenizer_families import FAMILIES, family_tokenizer
from titanium.data.chat import JinjaTemplate, Message
from titanium.data.tokenizer import HFTokenizer, TokenizerError

transformers = pytest.importorskip("transformers")

STRINGS = [
    *(str(i) for i in range(1000)),
    "2024 12345678 3.14159 -7 1,000,000 x19y",
    *(" " * n for n in (1, 2, 3, 7)),
    "\t\t",
    "\n",
    "\n\n\n",
    " \n \n",
    "a  b   c",
    " leading",
    "trailing ",
    "line\r\nbreak",
    "naïve café déjà vu",
    "e\u0301 (combining) vs \u00e9",
    "中文 字符 日本語",
    "🚀 emoji 👍🏽",
    "Straße ümlaut ÅÆØ",
    "Hello world! 19 foxes and 2024 dogs.",
    "code = {'a': [1, 2, 3]}\n    return x",
]
CONVERSATIONS = {
    "one turn": [Message("user", "What is 12 + 7?"), Message("assistant", "The answer is 19.")],
    "system, two turns": [
        Message("system", "Be brief."),
        Message("user", "Hello  world"),
        Message("assistant", "naïve 中文 🚀"),
        Message("user", "And 2024?"),
        Message("assistant", "It is 2024."),
    ],
}
NO_SYSTEM = ("mistral", "gemma2")  # (their templates have no system turn)
ONE_TURN_ONLY = ("qwen3", "qwen3_moe")  # Qwen3's template drops past reasoning: no multi-turn masks (refused)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: family_tokenizer(family, root / family) for family in FAMILIES}


def _auto(folder: Path):
    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("family", FAMILIES)
def test_ids_are_autotokenizers(folders, family):
    ours, auto = HFTokenizer(str(folders[family])), _auto(folders[family])
    assert ours.vocab_size == len(auto)
    assert ours.special_tokens == {t.content: i for i, t in auto.added_tokens_decoder.items()}
    assert ours.bos_id == auto.bos_token_id and ours.eos_id == auto.eos_token_id
    if auto.pad_token_id is not None:
        assert ours.pad_id == auto.pad_token_id
    differ = [s for s in STRINGS if ours.encode(s, bos=False, eos=False) != auto.encode(s, add_special_tokens=False)]
    assert not differ, f"{len(differ)} strings tokenize otherwise, e.g. {differ[:5]}"
    # Special-token strings in text stay text (user data cannot inject control tokens), as with split_special_tokens.
    text = " ".join(ours.special_tokens) + " 19 <|im_end|>x"
    assert (
        ours.encode(text, bos=False, eos=False)
        == auto(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    )
    for s in STRINGS[995:]:
        ids = ours.encode(s, bos=False, eos=False)
        assert ours.decode(ids) == auto.decode(ids)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_chat_template_ids_are_apply_chat_templates(folders, family, name):
    if family in ONE_TURN_ONLY and name != "one turn":
        pytest.skip("Qwen3's template is refused for multi-turn masks (test_chat_templates.py)")
    ours, auto = HFTokenizer(str(folders[family])), _auto(folders[family])
    chat = [m for m in CONVERSATIONS[name] if not (family in NO_SYSTEM and m.role == "system")]
    dicts = [m.as_dict() for m in chat]
    template = JinjaTemplate(ours, ours.chat_template)
    whole = auto.apply_chat_template(dicts, tokenize=True, return_dict=False)
    prompt = auto.apply_chat_template(dicts[:-1], tokenize=True, add_generation_prompt=True, return_dict=False)
    assert template.conversation_ids(chat) == whole
    assert template.prompt(chat[:-1]) == prompt
    tokens, trainable = template.tokenize(chat, train_on_input=False)
    assert tokens == whole and tokens[: len(prompt)] == prompt
    learned = ours.decode([t for t, keep in zip(tokens, trainable) if keep])
    assert learned.startswith(chat[-1].content.strip()) or chat[-1].content.strip() in learned


def test_the_issue_folder_differs_from_its_tokenizer_json(folders):
    """The reason for the above: run as a file, qwen2_plain's tokenizer.json splits numbers otherwise."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(folders["qwen2_plain"] / "tokenizer.json"))
    ours = HFTokenizer(str(folders["qwen2_plain"] / "tokenizer.json"))
    numbers = [str(i) for i in range(1000)]
    assert sum(raw.encode(n).ids != ours.encode(n, bos=False, eos=False) for n in numbers) > 10
    assert ours.encode("19", bos=False, eos=False) == _auto(folders["qwen2_plain"]).encode("19")


def test_without_transformers_a_model_folder_is_refused(folders, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(TokenizerError, match="transformers is not installed.*Qwen2Tokenizer splits digits"):
        HFTokenizer(str(folders["qwen2_plain"]))
    # A bare tokenizer.json (no model folder, no class of its own) is run as it is.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((folders["llama3"] / "tokenizer.json").read_bytes())
    assert HFTokenizer(str(bare / "tokenizer.json")).encode("19", bos=False, eos=False)
