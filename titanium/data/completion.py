"""TRL's prompt/completion rows, and the plain-text tokenization TRL gives rows of strings.

TRL (1.16) tells the forms apart by the row: a row with a ``prompt`` is prompt/completion (here: a row with a
``completion``, so that chat data carrying a ``prompt`` beside its ``messages``, as UltraChat does, stays a
conversation); strings are plain
text (a base model needs no chat template), lists of messages a conversation. Its rules, kept here so that
titanium's ids and loss masks equal TRL's (tests/unit/test_trl_formats.py checks them against TRL's own code):

- strings: ``tokenizer(prompt)`` and ``tokenizer(prompt + completion + eos_token)``, the EOS added unless the
  completion already ends with its text, BOS in front when the tokenizer has one. Unlike TRL, a special-token
  string inside the text stays text (it cannot inject control tokens), and the EOS is added by id;
- conversations: the chat template's generation prompt of ``prompt``, and the rendering of
  ``prompt + completion`` (with the row's tools);
- either way the completion starts where the two token lists first differ (a token that merges across the
  boundary belongs to the completion), and every token from there on is learned (TRL's completion_only_loss).

``max_prompt_length`` keeps a prompt's last tokens, BOS included in the cut, as TRL's trainers with that option
do (``prompt_ids[-max_prompt_length:]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from titanium.config.sections import DataSection
from titanium.data.chat import (
    ChatTemplate,
    Message,
    RowError,
    _text_field,
    check_conversation,
    parse_messages,
    parse_tools,
    with_system_prompt,
)
from titanium.data.text import DataError, Source
from titanium.data.tokenizer import Tokenizer


class NeedsTemplate(RowError):
    """A row of messages met with --chat.chat_template none: the configuration's fault, not the row's, so it
    stops the run whatever --data.on_bad_row says."""

    def error(self, source: Source, row: int) -> DataError:
        return DataError(
            f"{source.where(row)}: {self}, and --chat.chat_template is none (plain text); set --chat.chat_template "
            "auto (or tokenizer, llama3, qwen3, chatml) for rows of messages"
        )


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` share: where a completion starts after its tokenized prompt."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def plain_text(tokenizer: Tokenizer, text: str, eos: bool) -> list[int]:
    """``text`` as TRL tokenizes a string: BOS (if the tokenizer has one) + text, and with `eos` the EOS id,
    where a trailing EOS string in the text is that EOS rather than text followed by another."""
    if eos:
        name = next((n for n, i in tokenizer.special_tokens.items() if i == tokenizer.eos_id), None)
        if name:
            text = text.removesuffix(name)
    return tokenizer.encode(text, bos=True, eos=eos)


def is_prompt_completion(row: Any, cfg: DataSection) -> bool:
    """A row holding a completion is a prompt/completion row (else a conversation of messages)."""
    return isinstance(row, dict) and row.get(cfg.completion_column) is not None


def messages_of(value: Any, column: str, cfg: DataSection) -> list[Message]:
    """A column of messages (NeedsTemplate when there is no template is the caller's to raise)."""
    try:
        return parse_messages(value, f"'{column}'", cfg)
    except RowError as e:
        raise RowError(f"'{column}': {e}") from None


def prompt_completion_tokens(
    row: dict, cfg: DataSection, tokenizer: Tokenizer, template: ChatTemplate | None, system_prompt: str | None
) -> tuple[list[int], int]:
    """A prompt/completion row's ids, and how many of them are prompt (the rest is the completion)."""
    prompt, completion = row.get(cfg.prompt_column), row[cfg.completion_column]
    if prompt is None:
        raise RowError(f"a '{cfg.completion_column}' but no '{cfg.prompt_column}' column (columns: {sorted(row)})")
    if isinstance(prompt, str) and isinstance(completion, str):
        _text_field(prompt, f"'{cfg.prompt_column}'")
        _text_field(completion, f"'{cfg.completion_column}'")
        prompt_ids = plain_text(tokenizer, prompt, eos=False)
        tokens = plain_text(tokenizer, prompt + completion, eos=True)
    elif isinstance(prompt, list) and isinstance(completion, list):
        if template is None:
            raise NeedsTemplate(f"'{cfg.prompt_column}' and '{cfg.completion_column}' are messages")
        prompt_messages = with_system_prompt(messages_of(prompt, cfg.prompt_column, cfg), system_prompt)
        completion_messages = messages_of(completion, cfg.completion_column, cfg)
        if not prompt_messages or not completion_messages:
            raise RowError(f"an empty '{cfg.prompt_column}' or '{cfg.completion_column}'")
        conversation = check_conversation(prompt_messages + completion_messages)
        tools = parse_tools(row, cfg)
        prompt_ids = template.prompt(prompt_messages, tools)
        tokens, _ = template.tokenize(conversation, train_on_input=False, tools=tools)
    else:
        raise RowError(
            f"'{cfg.prompt_column}' is {type(prompt).__name__} and '{cfg.completion_column}' is "
            f"{type(completion).__name__}: both strings (plain text) or both lists of messages"
        )
    return tokens, common_prefix_length(prompt_ids, tokens)


def cut_prompt(tokens: list[int], prompt_len: int, max_prompt_length: int) -> tuple[list[int], int]:
    """Keep the last `max_prompt_length` of the first `prompt_len` tokens (0: no limit)."""
    if not max_prompt_length or prompt_len <= max_prompt_length:
        return tokens, prompt_len
    return tokens[prompt_len - max_prompt_length :], max_prompt_length
