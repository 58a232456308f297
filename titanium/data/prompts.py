"""Prompts for on-policy RL (GRPO): rows -> prompt tokens, with the reference answer carried along.

Rows are read like fine-tuning rows (``RowReader``: streamed, split over data-parallel ranks by row,
resumable, malformed rows skipped and counted or fatal per ``--data.on_bad_row``). By ``--data.kind``:

- chat: the row's messages. A final assistant message (the answer in SFT-style data) is dropped; what
  is left must end with a user (or tool) message. The prompt is the chat template's generation prompt (with
  the row's tools), the same tokens the SFT data and the evaluation put before an answer. A row without
  messages but with TRL's ``prompt`` column (``--data.prompt_column``) is read as TRL's GRPO reads it: a
  conversation (a list of messages ending with the turn to answer) or a string, here one user message.
- instruct: the instruction (and its input) as the user message.
- text: the text column as a plain prompt for base models: BOS + text, no template.

With an image-text model's processor (chat and instruct kinds), a row's images (``[vision] images_column``, or one
``image``, as TRL's GRPO reads them) go through the processor with the prompt, rendered by the processor's chat
template: the prompt's ids have the image placeholders expanded and the sample keeps the processor's image fields
(``images``), which the rollout engine's prefill and every training forward of its responses read (docs/vision.md). A
string prompt is one user message with the images before its text (TRL's ``prepare_multimodal_messages``); a missing
or unreadable image, or placeholders that do not match the images, skip the row and count it.

The ``answer_column`` value (as a string) and the whole row travel with the prompt to the reward functions.
Prompts longer than ``max_prompt_len`` tokens are skipped and counted (both keys of the RL objectives' ``[rl]``
section): cutting a question would make its answer wrong.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from titanium.config.sections import DataSection
from titanium.data.chat import (
    ChatTemplate,
    Message,
    RowError,
    _column,
    _text_field,
    instruct_user_message,
    parse_messages,
    parse_tools,
    with_system_prompt,
)
from titanium.data.completion import messages_of
from titanium.data.text import DataError, RowReader, Source
from titanium.data.tokenizer import Tokenizer
from titanium.data.vision import ImageData, messages_with_images, place_images, row_images
from titanium.data.vision_sft import source_folder, with_system

ANSWERED_ROLES = ("user", "tool")
"""The roles a prompt may end with: the model answers a user, or goes on after a tool's result."""

_FIX = {
    "chat": "fix the row, or point --data.messages_column, --data.role_key and --data.content_key at its columns",
    "instruct": "fix the row, or point --data.instruction_column and --data.input_column at its columns",
    "text": "fix the row, or set --data.text_column",
}


class PromptOptions(Protocol):
    """What a prompt stream reads of its section (``[rl]``)."""

    answer_column: str
    max_prompt_len: int


@dataclass(frozen=True)
class PromptSample:
    prompt: list[int]
    """Token ids the policy continues."""
    answer: str | None
    """The row's reference answer (None without the objective's ``answer_column``)."""
    row: Mapping[str, Any]
    """The whole row, for reward functions that use other columns."""
    text: str = ""
    """A plain text prompt as written (text data); empty for a conversation."""
    messages: tuple[Message, ...] = ()
    """The conversation answered, as the policy saw it (system prompt included); empty for plain text prompts."""
    images: Mapping[str, Any] | None = None
    """The prompt's image fields as the model's processor made them (``ImageData.tokens``; an image-text model's
    prompts); None for a text model's."""

    @property
    def as_written(self) -> str:
        """What is answered, as written (for logs): the text, or the content of the conversation's last message."""
        return (self.messages[-1].content or "") if self.messages else self.text

    @property
    def trl_prompt(self) -> str | list[dict[str, Any]]:
        """The prompt as TRL hands it to reward functions: the text, or the messages as role/content dicts."""
        return [m.as_dict() for m in self.messages] if self.messages else self.text


def trl_prompt(row: Any, data: DataSection) -> str | list[Message] | None:
    """TRL's ``prompt`` column of a row without ``messages``: a string, or a list of messages ending with the
    turn to answer (a user or tool message; TRL would continue a final assistant message, not supported here).
    None for a row without it."""
    if not isinstance(row, dict) or data.messages_column in row or row.get(data.prompt_column) is None:
        return None
    value = row[data.prompt_column]
    if isinstance(value, str):
        return _text_field(value, f"'{data.prompt_column}'")
    messages = _system_first(messages_of(value, data.prompt_column, data))
    if not messages or messages[-1].role not in ANSWERED_ROLES:
        ends = f"ends with a message of role {messages[-1].role!r}" if messages else "is an empty list of messages"
        raise RowError(f"'{data.prompt_column}' {ends}; a prompt ends with the user (or tool) turn to answer")
    return messages


def prompt_messages(row: Any, data: DataSection) -> list[Message]:
    """The conversation to answer: TRL's ``prompt`` (``trl_prompt``; a string is one user message), a chat row
    without its final assistant message, or an instruct row's user turn. Raises ``RowError`` when it does not
    end with a user or tool message."""
    if data.kind == "instruct":
        return [instruct_user_message(row, data)]
    prompt = trl_prompt(row, data)
    if prompt is not None:
        return [Message("user", prompt)] if isinstance(prompt, str) else prompt
    messages = parse_messages(_column(row, data.messages_column), f"'{data.messages_column}'", data)
    if messages and messages[-1].role == "assistant":
        messages = messages[:-1]
    if not messages or messages[-1].role not in ANSWERED_ROLES:
        raise RowError(
            "no user message to answer (a prompt ends with a user or tool message, or with one and its answer)"
        )
    return _system_first(messages)


def _text_of(content: str | list[dict[str, Any]]) -> str:
    """A message's text: its text parts joined (image parts left out)."""
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content if p["type"] == "text")


def _system_first(messages: list[Message]) -> list[Message]:
    if any(m.role == "system" for m in messages[1:]):
        raise RowError("a system message is only allowed as the first message")
    return messages


class PromptDataset(RowReader):
    """Infinite, resumable stream of ``PromptSample`` for one data-parallel rank.

    ``template`` formats chat and instruct prompts (None for kind text); ``system_prompt`` replaces or
    adds their system message. ``section`` gives ``answer_column`` and ``max_prompt_len`` (``[rl]``, named ``name`` in
    messages). Counters (kept in the state): ``bad_rows`` (skipped),
    ``too_long``. ``processor``: an image-text model's (module docstring); None for a text model.
    """

    def __init__(
        self,
        data: DataSection,
        section: PromptOptions,
        tokenizer: Tokenizer,
        template: ChatTemplate | None,
        system_prompt: str | None = None,
        dp_rank: int = 0,
        dp_world: int = 1,
        name: str = "rl",
        processor: ImageData | None = None,
    ) -> None:
        if data.kind not in _FIX:
            raise DataError(f"--data.kind {data.kind} has no prompts; use chat, instruct or text")
        if data.kind != "text" and template is None and processor is None:
            raise ValueError(f"--data.kind {data.kind} needs a chat template")
        super().__init__(data, dp_rank, dp_world)
        self.section, self.name = section, name
        self.tokenizer, self.template, self.system_prompt = tokenizer, template, system_prompt
        self.processor = processor if data.kind != "text" else None
        self.reads_images = self.processor is not None
        self.too_long = 0

    def _answer(self, item: Any) -> str | None:
        column = self.section.answer_column
        if not column:
            return None
        value = item.get(column) if isinstance(item, dict) else None
        if isinstance(value, str) or (isinstance(value, numbers.Number) and not isinstance(value, bool)):
            return str(value)
        found = "missing or null" if value is None else f"{type(value).__name__}, not a string or number"
        raise RowError(
            f"the answer column '{column}' is {found} (set --{self.name}.answer_column, or '' for rows without answers)"
        )

    def _sample(self, item: Any, source: Source, row: int) -> PromptSample | None:
        messages: list[Message] = []
        text, images = "", None
        try:
            if self.processor is not None:
                prompt, images, messages = self._image_prompt(item, source)
            elif self.cfg.kind == "text":
                text = self._text_of(item, source, row)
                if text is None:
                    return None
                prompt = self.tokenizer.encode(text, bos=True, eos=False)
            else:
                assert self.template is not None
                messages = with_system_prompt(prompt_messages(item, self.cfg), self.system_prompt)
                prompt = self.template.prompt(messages, parse_tools(item, self.cfg))
            answer = self._answer(item)
        except RowError as e:
            self._bad_row(source, row, str(e), _FIX[self.cfg.kind])
            return None
        if len(prompt) > self.section.max_prompt_len:
            self.too_long += 1
            return None
        return PromptSample(prompt, answer, item, text, tuple(messages), images)

    def _image_prompt(self, item: Any, source: Source) -> tuple[list[int], dict[str, Any], list[Message]]:
        """The conversation to answer (as ``prompt_messages`` finds it) with the row's images, through the processor:
        its ids, image fields, and its messages as text (for reward functions and logs)."""
        assert self.processor is not None
        data, processor = self.cfg, self.processor
        if data.kind == "instruct":
            raw: list[dict[str, Any]] = [instruct_user_message(item, data).as_dict()]
        elif isinstance(item, dict) and data.messages_column not in item and item.get(data.prompt_column) is not None:
            value = item[data.prompt_column]
            raw = [{"role": "user", "content": value}] if isinstance(value, str) else value
            raw = messages_with_images(raw, f"'{data.prompt_column}'", data)
        else:
            raw = messages_with_images(_column(item, data.messages_column), f"'{data.messages_column}'", data)
            if raw[-1]["role"] == "assistant":
                raw = raw[:-1]
        if not raw or raw[-1]["role"] not in ANSWERED_ROLES:
            raise RowError("no user message to answer (a prompt ends with a user or tool message, or with its answer)")
        if any(m["role"] == "system" for m in raw[1:]):
            raise RowError("a system message is only allowed as the first message")
        pictures = row_images(item, processor.vision.images_column, source_folder(source))
        raw = with_system(place_images(raw, len(pictures)), self.system_prompt)
        ids, _, fields = processor.tokens([(processor.render(raw, generation=True), "prompt")], pictures)
        return ids, fields, [Message(m["role"], _text_of(m["content"])) for m in raw]

    def __iter__(self) -> Iterator[PromptSample]:
        for source, row, item in self._rows():
            sample = self._sample(item, source, row)
            if sample is not None:
                self._pass_used = True
                yield sample

    def _unused_rows(self) -> list[str]:
        reasons = super()._unused_rows()
        if self.too_long:
            reasons.append(
                f"{self.too_long} prompts longer than --{self.name}.max_prompt_len {self.section.max_prompt_len} "
                "tokens skipped: raise it (with --training.seq_len, which must hold max_prompt_len + max_new_tokens)"
            )
        return reasons

    def state_dict(self) -> dict[str, Any]:
        return {**self._position(), "too_long": self.too_long}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_position(state)
        self.too_long = state["too_long"]
