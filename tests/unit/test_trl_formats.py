"""TRL's data formats: titanium's token ids and loss masks equal TRL 1.16's own tokenization of the same rows.

TRL's dataset preparation (SFTTrainer._prepare_dataset, DPOTrainer._prepare_dataset) is run as TRL ships it, on
a tokenizer trained here, with a real tool-capable chat template (Qwen 2.5's, read from TRL's installed copy):
prompt/completion rows as strings (plain text) and as conversations (with tools), preference rows as plain text,
tool calls and tool messages against transformers' apply_chat_template, and max_prompt_length's left cut.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from titanium.config.sections import DataSection, SFTSection
from titanium.data.chat import (
    JinjaTemplate,
    Llama3Template,
    Message,
    RowError,
    build_optional_chat_template,
    parse_chat_row,
)
from titanium.data.preference import PreferenceDataset
from titanium.data.sft import IGNORE_INDEX, SFTDataset, shifted_labels
from titanium.data.text import DataError
from titanium.data.tokenizer import ByteTokenizer, HFTokenizer

trl = pytest.importorskip("trl", reason="pip install 'trl>=1.16,<2' (in the dev extra) to compare with TRL")
TEMPLATES = Path(trl.__file__).parent / "chat_templates"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]
CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
TOOL_CHAT = [
    {"role": "user", "content": "what is 2 plus 3"},
    {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]},
    {"role": "tool", "content": "5"},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "the answer is 5"},
]


def make_tokenizer(folder: Path, bos: bool) -> tuple[HFTokenizer, Any]:
    """A tiny byte-level BPE trained here with Qwen 2.5's template, as titanium and transformers load it; `bos`:
    Llama-style, its post-processor puts <s> first and </s> is the EOS; else Qwen-style (no BOS, <|im_end|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["what is the answer plus two three user assistant tool call", "hello world"] * 10, trainer)
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"])
    config: dict[str, Any] = {"chat_template": (TEMPLATES / "qwen2_5.jinja").read_text()}
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
        config |= {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<|endoftext|>"}
    else:
        config |= {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return HFTokenizer(str(folder / "tokenizer.json")), AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module", params=["no BOS", "BOS"])
def toks(request, tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"), bos=request.param == "BOS")


def jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def one_pass(dataset, n: int) -> list:
    it = iter(dataset)
    return [next(it) for _ in range(n)]


def trl_sft(rows: list[dict], hf_tok) -> list[dict]:
    """SFTTrainer's own preparation (completion_only_loss, its default for prompt/completion data)."""
    from datasets import Dataset
    from trl import SFTTrainer

    trainer = SimpleNamespace(_tokenizer=hf_tok, chat_template=None, completion_only_loss=True)
    args = SimpleNamespace(
        dataset_num_proc=None,
        dataset_text_field="text",
        assistant_only_loss=False,
        max_length=None,
        shuffle_dataset=False,
    )
    prepared = SFTTrainer._prepare_dataset(trainer, Dataset.from_list(rows), hf_tok, args, False, None, "train")
    return list(prepared)


def trl_dpo(rows: list[dict], hf_tok) -> list[dict]:
    """DPOTrainer's own preparation: prompt_ids, chosen_ids, rejected_ids per row."""
    from datasets import Dataset
    from trl import DPOTrainer

    trainer = SimpleNamespace(_tokenizer=hf_tok)
    args = SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
    return list(DPOTrainer._prepare_dataset(trainer, Dataset.from_list(rows), hf_tok, args, "train"))


def sft_samples(path: str, tok, template, n: int, **sft: Any) -> tuple[list[dict], SFTDataset]:
    dataset = SFTDataset(DataSection(kind="chat", path=path), SFTSection(**sft), tok, template, seq_len=4096)
    return one_pass(dataset, n), dataset


def as_titanium(input_ids: list[int], labels: list[int]) -> dict[str, list[int]]:
    """TRL's unshifted labels (the model shifts) as titanium's sample, whose labels are shifted in the data."""
    return {"tokens": input_ids, "labels": [*labels[1:], IGNORE_INDEX]}


def test_string_prompt_completion_equals_trl(toks, tmp_path):
    tok, hf = toks
    rows = [
        {"prompt": "what is the answer", "completion": " hello world"},
        {"prompt": "two plus three is ", "completion": "five"},  # " " + "five" merge: the completion starts earlier
        {"prompt": "hello", "completion": " world" + hf.eos_token},  # ends with the EOS string: no second EOS
    ]
    expected = [as_titanium(r["input_ids"], r["labels"]) for r in trl_sft(rows, hf)]
    # Plain text whatever the template (TRL's rule for strings); none needs no template at all.
    for name in ("tokenizer", "none"):
        template = build_optional_chat_template(name, tok, "qwen3")
        samples, _ = sft_samples(jsonl(tmp_path / "rows.jsonl", rows), tok, template, len(rows))
        assert samples == expected
    merged = expected[1]
    assert sum(label != IGNORE_INDEX for label in merged["labels"]) >= 1


def conversational_rows() -> list[dict]:
    return [
        {"prompt": [{"role": "user", "content": "what is the answer"}], "completion": [TOOL_CHAT[4]], "tools": None},
        {
            "prompt": TOOL_CHAT[:1],
            "completion": TOOL_CHAT[1:],  # tool calls, two tool results, the answer: all of it learned
            "tools": json.dumps(TOOLS),
        },
        {
            "prompt": [{"role": "system", "content": "be brief"}, *TOOL_CHAT[:1]],
            "completion": [TOOL_CHAT[4]],
            "tools": None,
        },
    ]


def test_conversational_prompt_completion_with_tools_equals_trl(toks, tmp_path):
    tok, hf = toks
    rows = conversational_rows()
    expected = [as_titanium(r["input_ids"], r["labels"]) for r in trl_sft(rows, hf)]
    template = build_optional_chat_template("tokenizer", tok, "qwen3")
    samples, dataset = sft_samples(jsonl(tmp_path / "rows.jsonl", rows), tok, template, len(rows))
    assert samples == expected
    assert dataset.bad_rows == 0
    assert "<tool_call>" in tok.decode(samples[1]["tokens"])


def test_string_preference_pairs_equal_trls_dpo_tokenization(toks, tmp_path):
    tok, hf = toks
    rows = [
        {"prompt": "what is the answer", "chosen": " five", "rejected": " hello world"},
        {"prompt": "two plus three is ", "chosen": "five", "rejected": "six"},
    ]
    reference = trl_dpo(rows, hf)
    pairs = one_pass(
        PreferenceDataset(
            DataSection(kind="preference", path=jsonl(tmp_path / "p.jsonl", rows)),
            None,
            4096,
            tok.bos_id,
            tokenizer=tok,
        ),
        len(rows),
    )
    for pair, ref in zip(pairs, reference):
        for sample, side in ((pair.chosen, ref["chosen_ids"]), (pair.rejected, ref["rejected_ids"])):
            tokens = ref["prompt_ids"] + side
            assert sample == {
                "tokens": tokens,
                "labels": shifted_labels(tokens, [False] * len(ref["prompt_ids"]) + [True] * len(side)),
            }


def test_conversational_preference_pairs_with_tools_equal_trls_dpo_tokenization(toks, tmp_path):
    tok, hf = toks
    answer = [{"role": "assistant", "content": "the answer is 5"}]
    rows = [
        {
            "prompt": TOOL_CHAT[:4],
            "chosen": answer,
            "rejected": [{**answer[0], "content": "6"}],
            "tools": json.dumps(TOOLS),
        },
        {
            "prompt": TOOL_CHAT[:1],
            "chosen": answer,
            "rejected": [{"role": "assistant", "content": "six"}],
            "tools": None,
        },
    ]
    reference = trl_dpo(rows, hf)
    template = build_optional_chat_template("tokenizer", tok, "qwen3")
    data = DataSection(kind="preference", path=jsonl(tmp_path / "p.jsonl", rows))
    dataset = PreferenceDataset(data, template, 4096, tok.bos_id)
    pairs = one_pass(dataset, len(rows))
    assert dataset.bad_rows == 0
    for pair, ref in zip(pairs, reference):
        for sample, side in ((pair.chosen, ref["chosen_ids"]), (pair.rejected, ref["rejected_ids"])):
            tokens = ref["prompt_ids"] + side
            mask = [False] * len(ref["prompt_ids"]) + [True] * len(side)
            assert sample == {"tokens": tokens, "labels": shifted_labels(tokens, mask)}
    assert "<tools>" in tok.decode(pairs[0].chosen["tokens"])


def test_max_prompt_length_keeps_the_prompts_end_as_trl(toks, tmp_path):
    """TRL's rule (its trainers with max_prompt_length): prompt_ids[-max_prompt_length:], BOS included in the cut."""
    tok, hf = toks
    keep = 3
    rows = [{"prompt": "what is the answer plus two", "chosen": " five", "rejected": " six"}]
    ref = trl_dpo(rows, hf)[0]
    assert len(ref["prompt_ids"]) > keep
    data = DataSection(kind="preference", path=jsonl(tmp_path / "p.jsonl", rows))
    dataset = PreferenceDataset(data, None, 4096, tok.bos_id, tokenizer=tok, max_prompt_length=keep)
    pair = one_pass(dataset, 1)[0]
    assert pair.chosen["tokens"] == ref["prompt_ids"][-keep:] + ref["chosen_ids"]
    assert dataset.prompt_truncated >= 1

    sft_rows = [{"prompt": "what is the answer plus two", "completion": " five"}]
    full = trl_sft(sft_rows, hf)[0]
    start = full["labels"].index(next(x for x in full["labels"] if x != IGNORE_INDEX))  # TRL's prompt length
    want = as_titanium(full["input_ids"][start - keep :], full["labels"][start - keep :])
    samples, sft = sft_samples(jsonl(tmp_path / "s.jsonl", sft_rows), tok, None, 1, max_prompt_length=keep)
    assert samples == [want]
    assert sft.prompt_truncated == 1


def test_tool_calls_render_and_mask_as_transformers(toks):
    tok, hf = toks
    chat = parse_chat_row({"messages": TOOL_CHAT}, DataSection())
    assert chat[1] == Message("assistant", "", {"tool_calls": [CALL, CALL]})
    ids = hf.apply_chat_template(TOOL_CHAT, tools=TOOLS, tokenize=True, return_dict=True)["input_ids"]
    tokens, _ = JinjaTemplate(tok, hf.chat_template).tokenize(chat, False, TOOLS)
    assert tokens == ids
    # Masks: TRL's training variant marks the assistant's text with {% generation %}; transformers turns that
    # into its assistant mask, titanium finds the same tokens by rendering growing prefixes, except the newline
    # after "<|im_start|>assistant", which the generation prompt holds (the model is given it, never writes it).
    training = (TEMPLATES / "qwen2_5_training.jinja").read_text()
    out = hf.apply_chat_template(
        TOOL_CHAT, tools=TOOLS, chat_template=training, return_assistant_tokens_mask=True, return_dict=True
    )
    tokens, trainable = JinjaTemplate(tok, training).tokenize(chat, False, TOOLS)
    assert tokens == out["input_ids"]
    mask = out["assistant_masks"]
    assert all(mask[i] for i, learned in enumerate(trainable) if learned)
    only_transformers = [i for i, learned in enumerate(trainable) if mask[i] and not learned]
    assert len(only_transformers) == 2  # one per assistant turn
    assert all(tok.decode(tokens[: i + 1]).endswith("<|im_start|>assistant\n") for i in only_transformers)
    assert all(tok.decode(tokens[i : i + 1]) == "\n" for i in only_transformers)
    prompt = JinjaTemplate(tok, hf.chat_template).prompt(chat[:1], TOOLS)
    assert (
        prompt
        == hf.apply_chat_template(TOOL_CHAT[:1], tools=TOOLS, add_generation_prompt=True, return_dict=True)["input_ids"]
    )


def test_control_tokens_in_tool_calls_or_schemas_are_refused(toks):
    tok, hf = toks
    template = JinjaTemplate(tok, hf.chat_template)
    chat = parse_chat_row({"messages": TOOL_CHAT}, DataSection())
    injected = {"type": "function", "function": {"name": "add", "arguments": {"a": "<|im_end|>"}}}
    with pytest.raises(RowError, match="assistant message contains the control token '<\\|im_end\\|>'"):
        template.tokenize([chat[0], Message("assistant", "", {"tool_calls": [injected]})], False, TOOLS)
    with pytest.raises(RowError, match="the tools column contains the control token"):
        template.tokenize(chat, False, [{"type": "function", "function": {"name": "<|im_start|>"}}])


def test_a_template_that_cannot_render_tools_skips_the_row(tmp_path, caplog):
    tok = ByteTokenizer()
    rows = [{"messages": TOOL_CHAT}, {"messages": TOOL_CHAT[:1] + TOOL_CHAT[4:]}]
    samples, dataset = sft_samples(jsonl(tmp_path / "rows.jsonl", rows), tok, Llama3Template(tok), 1)
    assert dataset.bad_rows == 1 and len(samples) == 1
    assert "row 0" in caplog.text and "only a tokenizer's own chat template renders" in caplog.text


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "q", "completion": [TOOL_CHAT[4]]}, "'prompt' is str and 'completion' is list"),
        ({"completion": "a"}, "a 'completion' but no 'prompt' column"),
        ({"prompt": 5, "completion": 6}, "'prompt' is int and 'completion' is int"),
        ({"prompt": [], "completion": []}, "an empty 'prompt' or 'completion'"),
        ({"messages": TOOL_CHAT[:1] + TOOL_CHAT[4:], "tools": "{not json"}, "'tools' is a string but not JSON"),
        ({"messages": TOOL_CHAT[:1] + TOOL_CHAT[4:], "tools": [1]}, "'tools' is not a list of tool schemas"),
        ({"messages": [TOOL_CHAT[0], {**TOOL_CHAT[1], "tool_calls": "x"}]}, "'tool_calls' is str, not a list"),
    ],
)
def test_bad_prompt_completion_and_tool_rows_are_skipped_and_named(tmp_path, caplog, row, message):
    tok = ByteTokenizer()
    good = {"prompt": "q", "completion": "a"}
    samples, dataset = sft_samples(jsonl(tmp_path / "rows.jsonl", [row, good]), tok, Llama3Template(tok), 1)
    assert dataset.bad_rows == 1 and len(samples) == 1
    assert "rows.jsonl: row 0" in caplog.text and message in caplog.text


def test_messages_without_a_template_stop_the_run_naming_the_row(tmp_path):
    tok = ByteTokenizer()
    rows = [{"prompt": "q", "completion": "a"}, {"prompt": TOOL_CHAT[:1], "completion": TOOL_CHAT[4:]}]
    with pytest.raises(
        DataError, match=r"rows\.jsonl: row 1: .*messages, and --chat.chat_template is none \(plain text\); set"
    ):
        sft_samples(jsonl(tmp_path / "rows.jsonl", rows), tok, None, 2)
    pairs = [{"prompt": TOOL_CHAT[:1], "chosen": "a", "rejected": "b"}]
    data = DataSection(kind="preference", path=jsonl(tmp_path / "p.jsonl", pairs))
    with pytest.raises(DataError, match=r"p\.jsonl: row 0: .*holds messages, and --chat.chat_template is none"):
        one_pass(PreferenceDataset(data, None, 64, tok.bos_id, tokenizer=tok), 1)


def test_train_on_input_learns_the_prompt_too(tmp_path):
    tok = ByteTokenizer()
    path = jsonl(tmp_path / "rows.jsonl", [{"prompt": "ab", "completion": "c"}])
    (sample,), _ = sft_samples(path, tok, None, 1, train_on_input=True)
    assert sample["tokens"] == [tok.bos_id, *b"abc", tok.eos_id]
    assert sample["labels"] == [*b"abc", tok.eos_id, IGNORE_INDEX]


def test_grpo_reads_trls_prompt_column_as_trl_renders_it(tmp_path, toks):
    """GRPO's prompts from TRL's rows without ``messages``: a conversation in ``prompt`` (ending with a user turn or
    with the tools' results, the row's tools rendered) is the ids of transformers' ``apply_chat_template(prompt,
    tools=..., add_generation_prompt=True)``; a string is one user message; the answer column travels along."""
    from titanium.config.sections import RLSection
    from titanium.data.prompts import PromptDataset

    tok, hf = toks
    user = {"role": "user", "content": "what is two plus three"}
    rows = [
        {"prompt": "what is the answer", "answer": "5"},
        {"prompt": [{"role": "system", "content": "Be brief."}, user], "answer": "5"},
        {"prompt": TOOL_CHAT[:4], "tools": TOOLS, "answer": "x"},
        {"prompt": [user, {"role": "assistant", "content": "5"}], "answer": "5"},  # (no turn to answer: skipped)
    ]
    data = DataSection(kind="chat", path=jsonl(tmp_path / "rows.jsonl", rows))
    grpo = RLSection(answer_column="answer", max_prompt_len=4096)
    dataset = PromptDataset(data, grpo, tok, JinjaTemplate(tok, hf.chat_template))
    samples = [sample for sample, _ in zip(dataset, range(3))]
    expected = []
    for row in rows[:3]:
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        rendered = hf.apply_chat_template(messages, tools=row.get("tools"), add_generation_prompt=True, tokenize=True)
        expected.append(list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered))
    assert [s.prompt for s in samples] == expected
    assert [s.answer for s in samples] == ["5", "5", "x"] and dataset.bad_rows == 1
