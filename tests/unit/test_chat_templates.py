"""Chat templates: exact tokens and masks (Llama 3, ChatML, a tokenizer's Jinja template), and row parsing."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from titanium.config.sections import DataSection, SFTSection
from titanium.data.chat import (
    CHATML_JINJA,
    LLAMA3_JINJA,
    QWEN3_JINJA,
    ChatMLTemplate,
    ChatTemplateError,
    JinjaTemplate,
    Llama3Template,
    Message,
    Qwen3Template,
    RowError,
    build_chat_template,
    parse_chat_row,
    parse_instruct_row,
    with_system_prompt,
)
from titanium.data.sft import SFTDataset
from titanium.data.text import DataError
from titanium.data.tokenizer import HFTokenizer, TiktokenTokenizer
from titanium.models import default_chat_format

REPO = Path(__file__).resolve().parents[2]
CONVERSATION = [
    Message("system", "Be brief."),
    Message("user", "What is 2+2?"),
    Message("assistant", "4"),
    Message("user", "And 3+3?"),
    Message("assistant", "It is 6."),
]


def make_hf_tokenizer(folder: Path, chat_template: str | None = CHATML_JINJA) -> HFTokenizer:
    """A tiny Qwen-style byte-level BPE (trained here) with ChatML specials and a Jinja chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["user assistant system what is the answer", "hello world"] * 10, trainer)
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return HFTokenizer(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def tiktoken_tok() -> TiktokenTokenizer:
    return TiktokenTokenizer(str(REPO / "assets/tokenizer/titanium_debug.tiktoken"))


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory) -> HFTokenizer:
    return make_hf_tokenizer(tmp_path_factory.mktemp("qwen"))


def expected(pieces: list[tuple[list[int], bool]], train_on_input: bool) -> tuple[list[int], list[bool]]:
    """Pieces of (ids, is_answer) -> tokens and the trainable mask the template must produce."""
    tokens = [i for ids, _ in pieces for i in ids]
    return tokens, [answer or train_on_input for ids, answer in pieces for _ in ids]


@pytest.mark.parametrize("train_on_input", [False, True])
def test_llama3_exact_tokens(tiktoken_tok, train_on_input):
    tok, s = tiktoken_tok, tiktoken_tok.special_tokens
    enc = lambda text: tok.encode(text, bos=False, eos=False)  # noqa: E731

    def header(role: str) -> list[int]:
        return [s["<|start_header_id|>"], *enc(role), s["<|end_header_id|>"], *enc("\n\n")]

    messages = [Message("user", "  What is 2+2? "), Message("assistant", "4\n")]  # content is stripped
    tokens, trainable = expected(
        [
            (header("user") + enc("What is 2+2?") + [s["<|eot_id|>"]], False),
            (header("assistant"), False),
            (enc("4") + [s["<|eot_id|>"]], True),
        ],
        train_on_input,
    )
    template = Llama3Template(tok)
    assert template.tokenize(messages, train_on_input) == ([tok.bos_id, *tokens], [False, *trainable])
    assert template.prompt(messages[:1]) == [tok.bos_id, *tokens[: -len(enc("4")) - 1]]
    assert template.stop_ids == {s["<|eot_id|>"], tok.eos_id}


@pytest.mark.parametrize("train_on_input", [False, True])
def test_chatml_exact_tokens(hf_tok, train_on_input):
    tok, s = hf_tok, hf_tok.special_tokens
    enc = lambda text: tok.encode(text, bos=False, eos=False)  # noqa: E731
    start, end, nl = s["<|im_start|>"], s["<|im_end|>"], enc("\n")
    messages = [Message("system", "Be brief."), Message("user", "hello"), Message("assistant", "world")]
    tokens, trainable = expected(
        [
            ([start, *enc("system\n"), *enc("Be brief."), end, *nl], False),
            ([start, *enc("user\n"), *enc("hello"), end, *nl], False),
            ([start, *enc("assistant\n")], False),
            ([*enc("world"), end, *nl], True),
        ],
        train_on_input,
    )
    template = ChatMLTemplate(tok)
    assert template.tokenize(messages, train_on_input) == (tokens, trainable)  # no BOS
    assert template.prompt(messages[:2]) == tokens[: -len(enc("world")) - 1 - len(nl)]
    assert template.stop_ids == {end}  # eos is <|im_end|> here


@pytest.mark.parametrize("train_on_input", [False, True])
def test_jinja_chatml_matches_chatml_template(hf_tok, train_on_input):
    jinja = build_chat_template("auto", hf_tok, "llama3")  # the tokenizer's own template wins
    assert isinstance(jinja, JinjaTemplate)
    chatml = ChatMLTemplate(hf_tok)
    assert jinja.tokenize(CONVERSATION, train_on_input) == chatml.tokenize(CONVERSATION, train_on_input)
    assert jinja.prompt(CONVERSATION[:-1]) == chatml.prompt(CONVERSATION[:-1])
    assert jinja.stop_ids == chatml.stop_ids
    text = hf_tok.decode(jinja.tokenize(CONVERSATION, train_on_input)[0])
    assert text == jinja._template.render(messages=[m.__dict__ for m in CONVERSATION], add_generation_prompt=False)


@pytest.mark.parametrize("train_on_input", [False, True])
def test_jinja_llama3_matches_llama3_template_and_bos_is_never_trained(tiktoken_tok, train_on_input):
    jinja = JinjaTemplate(tiktoken_tok, LLAMA3_JINJA)
    llama3 = Llama3Template(tiktoken_tok)
    tokens, trainable = jinja.tokenize(CONVERSATION, train_on_input)
    assert (tokens, trainable) == llama3.tokenize(CONVERSATION, train_on_input)
    assert tokens[0] == tiktoken_tok.bos_id and not trainable[0]
    assert jinja.prompt(CONVERSATION[:-1]) == llama3.prompt(CONVERSATION[:-1])
    assert jinja.stop_ids == llama3.stop_ids


@pytest.fixture(scope="module")
def qwen3_tok(tmp_path_factory) -> HFTokenizer:
    """The ChatML test tokenizer plus Qwen3's <think> and </think> as added (non-special) tokens."""
    folder = tmp_path_factory.mktemp("qwen3")
    make_hf_tokenizer(folder)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens(["<think>", "</think>"])
    tok.save(str(folder / "tokenizer.json"))
    return HFTokenizer(str(folder / "tokenizer.json"))


QWEN3_CHATS = {
    "single": [Message("user", "What is 2+2?"), Message("assistant", "4")],
    "system, multi-turn": CONVERSATION,
    "answer starting with newlines": [
        Message("user", "hi"),
        Message("assistant", "\n\nhello"),
        Message("user", "again"),
        Message("assistant", "\nworld"),
    ],
}


@pytest.mark.parametrize("name", list(QWEN3_CHATS))
def test_qwen3_template_renders_what_qwen3s_own_template_renders(qwen3_tok, name):
    chat = QWEN3_CHATS[name]
    qwen3 = build_chat_template("qwen3", qwen3_tok, "qwen3")
    jinja = JinjaTemplate(qwen3_tok, QWEN3_JINJA)  # for its renderer and its text -> ids
    dicts = [m.__dict__ for m in chat]
    rendered = jinja._template.render(messages=dicts, add_generation_prompt=False)
    assert "<think>\n\n</think>\n\n" in rendered and rendered.count("<think>") == 1  # the last answer only
    tokens, trainable = qwen3.tokenize(chat, train_on_input=False)
    assert qwen3_tok.decode(tokens) == rendered
    assert tokens == jinja._encode(rendered, at_start=True)
    assert qwen3_tok.special_tokens["<think>"] in tokens
    # The loss is on the assistant answers and their end of turn only, never on the empty thinking block
    # (Qwen3 strips the newlines that start the last answer).
    answers = [m.content.lstrip("\n") if k == len(chat) - 1 else m.content for k, m in enumerate(chat)]
    expected = "".join(a + "<|im_end|>\n" for m, a in zip(chat, answers) if m.role == "assistant")
    assert qwen3_tok.decode([t for t, keep in zip(tokens, trainable) if keep]) == expected
    assert qwen3.tokenize(chat, train_on_input=True)[1] == [True] * len(tokens)
    # Served without thinking (enable_thinking=False), the model continues exactly the trained prefix.
    prompt = qwen3.prompt(chat[:-1])
    served = jinja._template.render(messages=dicts[:-1], add_generation_prompt=True, enable_thinking=False)
    assert qwen3_tok.decode(prompt) == served and prompt == jinja._encode(served, at_start=True)
    assert tokens[: len(prompt)] == prompt and qwen3.stop_ids == {qwen3_tok.special_tokens["<|im_end|>"]}


def test_qwen3_template_refuses_reasoning_it_would_reformat(qwen3_tok):
    with pytest.raises(RowError, match="</think>"):
        build_chat_template("qwen3", qwen3_tok, "qwen3").tokenize(
            [Message("user", "q"), Message("assistant", "<think>x</think>y")], False
        )


def test_jinja_refuses_templates_without_the_prefix_property(hf_tok):
    changing = CHATML_JINJA.replace("message['content']", "message['content'] + ('!' if loop.last else '')")
    with pytest.raises(ChatTemplateError, match="renders earlier messages differently"):
        JinjaTemplate(hf_tok, changing)
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        JinjaTemplate(hf_tok, "{% for %}")
    with pytest.raises(ChatTemplateError, match="plain user/assistant conversation .*no tools.*--chat.chat_template"):
        JinjaTemplate(hf_tok, "{{ raise_exception('no tools') }}")


ALTERNATING_JINJA = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% endfor %}" + CHATML_JINJA
)


def test_a_row_the_tokenizers_template_rejects_is_a_bad_row(hf_tok, tmp_path, caplog):
    """raise_exception() on one conversation is that row's fault: skipped and counted, or named with `fail`."""
    rows = [[("user", "a"), ("assistant", "b")], [("user", "a"), ("user", "b"), ("assistant", "c")]]
    rows += [[("user", "d"), ("assistant", "e")]]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": r, "content": c} for r, c in m]}) + "\n" for m in rows))
    template = JinjaTemplate(hf_tok, ALTERNATING_JINJA)
    with pytest.raises(RowError, match="chat_template rejected it: Conversation roles must alternate"):
        template.tokenize([Message("user", "a"), Message("user", "b"), Message("assistant", "c")], False)

    def samples(on_bad_row: str) -> tuple[SFTDataset, list]:
        ds = SFTDataset(
            DataSection(kind="chat", path=str(path), on_bad_row=on_bad_row), SFTSection(), hf_tok, template, 64
        )
        it = iter(ds)
        return ds, [next(it) for _ in range(2)]

    ds, got = samples("skip")
    assert [hf_tok.decode(s["tokens"]).split("assistant\n")[-1] for s in got] == ["b<|im_end|>\n", "e<|im_end|>\n"]
    assert ds.bad_rows == 1 and f"--data.path {path}: row 1: the tokenizer's chat_template rejected it" in caplog.text
    with pytest.raises(DataError, match=rf"--data.path {path}: row 1: the tokenizer's chat_template rejected it: "):
        samples("fail")


def test_jinja_generation_blocks_render_as_in_transformers(hf_tok):
    """HF templates mark assistant text with {% generation %} (for its assistant masks); it renders its body."""
    marked = CHATML_JINJA.replace(
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}",
        "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
        "{% set answer = message['content'] %}{{ answer + '<|im_end|>' + '\\n' }}{% endgeneration %}"
        "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{% endif %}",
    )
    assert marked != CHATML_JINJA
    conversation = CONVERSATION[1:]
    assert JinjaTemplate(hf_tok, marked).tokenize(conversation, False) == ChatMLTemplate(hf_tok).tokenize(
        conversation, False
    )
    transformers_render = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    dicts = [m.as_dict() for m in conversation]
    ours = JinjaTemplate(hf_tok, marked)._render(conversation, False, None)
    assert ours == transformers_render([dicts], chat_template=marked)[0][0]


def test_jinja_strftime_now_gives_todays_date(hf_tok):
    conversation = CONVERSATION[1:]
    dated = "{{ '<|im_start|>system\\nToday is ' + strftime_now('%d %b %Y') + '<|im_end|>\\n' }}" + CHATML_JINJA
    tokens, _ = JinjaTemplate(hf_tok, dated).tokenize(conversation, False)
    today = datetime.date.today().strftime("%d %b %Y")
    assert hf_tok.decode(tokens).startswith(f"<|im_start|>system\nToday is {today}<|im_end|>\n<|im_start|>user\n")


def test_jinja_is_sandboxed(hf_tok):
    with pytest.raises(ChatTemplateError, match="attribute '__class__' of 'list' object is unsafe"):
        JinjaTemplate(hf_tok, "{{ messages.__class__.__mro__[1].__subclasses__() }}")


def test_control_tokens_in_content_are_text_or_refused(hf_tok):
    sneaky = [Message("user", "hi <|im_end|>"), Message("assistant", "ok")]
    with pytest.raises(RowError, match="control token '<\\|im_end\\|>'"):
        JinjaTemplate(hf_tok, CHATML_JINJA).tokenize(sneaky, False)
    tokens, _ = ChatMLTemplate(hf_tok).tokenize(sneaky, False)  # written templates encode it as plain text
    assert tokens.count(hf_tok.special_tokens["<|im_end|>"]) == 2


def test_missing_special_tokens_are_a_clear_error(tiktoken_tok, hf_tok):
    with pytest.raises(ChatTemplateError, match="chatml needs the special tokens <\\|im_start\\|>"):
        ChatMLTemplate(tiktoken_tok)
    with pytest.raises(ChatTemplateError, match="llama3 needs .* lacks <\\|begin_of_text\\|>"):
        build_chat_template("llama3", hf_tok, "llama3")


def test_build_chat_template_choices(tiktoken_tok, tmp_path):
    assert isinstance(build_chat_template("auto", tiktoken_tok, default_chat_format("llama3")), Llama3Template)
    plain = make_hf_tokenizer(tmp_path / "plain", chat_template=None)
    assert plain.chat_template is None
    assert type(build_chat_template("auto", plain, default_chat_format("qwen3"))) is Qwen3Template
    assert type(build_chat_template("auto", plain, default_chat_format("qwen2"))) is ChatMLTemplate  # (registered)
    assert default_chat_format("mystery") == default_chat_format("gemma2") == ""  # (gemma2: its tokenizer's, or none)
    with pytest.raises(ChatTemplateError, match="the model family has no default format; set --chat.chat_template"):
        build_chat_template("auto", plain, default_chat_format("gemma2"))
    with pytest.raises(ChatTemplateError, match="has no chat_template"):
        build_chat_template("tokenizer", tiktoken_tok, "llama3")
    with pytest.raises(ChatTemplateError, match="unknown --chat.chat_template"):
        build_chat_template("vicuna", tiktoken_tok, "llama3")


def test_hf_chat_template_sources(tmp_path):
    listed = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHATML_JINJA}]
    assert make_hf_tokenizer(tmp_path / "list", chat_template=listed).chat_template == CHATML_JINJA  # type: ignore[arg-type]
    (tmp_path / "file").mkdir()
    (tmp_path / "file" / "chat_template.jinja").write_text(LLAMA3_JINJA)
    assert make_hf_tokenizer(tmp_path / "file", chat_template=None).chat_template == LLAMA3_JINJA


# ----------------------------------------------------------------------------------------------- rows

CHAT = DataSection(kind="chat")
SHAREGPT = DataSection(kind="chat", messages_column="conversations", role_key="from", content_key="value")


def test_parse_chat_and_sharegpt_rows():
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": 1}]}
    # Other keys travel with the message, as transformers hands them to a Jinja template.
    assert parse_chat_row(row, CHAT) == [Message("user", "a"), Message("assistant", "b", {"weight": 1})]
    share = {"conversations": [{"from": f, "value": v} for f, v in [("system", "s"), ("human", "a"), ("gpt", "b")]]}
    assert parse_chat_row(share, SHAREGPT) == [Message("system", "s"), Message("user", "a"), Message("assistant", "b")]


def test_parse_instruct_rows():
    cfg = DataSection(kind="instruct")
    row = {"instruction": "Add.", "input": "2 3", "output": "5"}
    assert parse_instruct_row(row, cfg) == [Message("user", "Add.\n\n2 3"), Message("assistant", "5")]
    for empty in ("", "  ", None):
        assert parse_instruct_row({**row, "input": empty}, cfg)[0] == Message("user", "Add.")
    assert parse_instruct_row({"instruction": "Hi", "output": "Yo"}, cfg)[0] == Message("user", "Hi")
    custom = DataSection(kind="instruct", instruction_column="q", input_column="ctx", output_column="a")
    assert parse_instruct_row({"q": "Q", "ctx": "C", "a": "A"}, custom)[1] == Message("assistant", "A")
    with pytest.raises(RowError, match="'output' is missing"):
        parse_instruct_row({"instruction": "Hi"}, cfg)
    with pytest.raises(RowError, match="'input' is int"):
        parse_instruct_row({**row, "input": 3}, cfg)


def _messages(*pairs):
    return {"messages": [{"role": r, "content": c} for r, c in pairs]}


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"text": "x"}, "no 'messages' column"),
        ({"messages": None}, "no 'messages' column"),
        ({"messages": "hi"}, "'messages' is str, not a list"),
        ({"messages": []}, "no messages"),
        ({"messages": ["hi"]}, "message 0 is str"),
        ({"messages": [{"content": "hi"}]}, "message 0 has no 'role'"),
        (_messages(("bot", "hi")), "unknown role 'bot'"),
        (_messages(("user", "a"), ("assistant", "   ")), "message 1 'content' is empty"),
        (_messages(("user", "a"), ("assistant", None)), "message 1 'content' is missing"),
        (_messages(("user", "a"), ("assistant", 5)), "message 1 'content' is int"),
        (_messages(("user", "a")), "ends with a user message"),
        (_messages(("user", "a"), ("assistant", "b"), ("user", "c")), "ends with a user message"),
        (_messages(("user", "a"), ("system", "s"), ("assistant", "b")), "system message is only allowed as the first"),
        ([1, 2], "not an object with columns"),
    ],
)
def test_malformed_chat_rows(row, reason):
    with pytest.raises(RowError, match=reason):
        parse_chat_row(row, CHAT)


def test_system_prompt_replaces_or_adds():
    convo = [Message("user", "a"), Message("assistant", "b")]
    assert with_system_prompt(convo, "S")[0] == Message("system", "S")
    assert with_system_prompt([Message("system", "old"), *convo], "S") == [Message("system", "S"), *convo]
    assert with_system_prompt(convo, None) is convo
