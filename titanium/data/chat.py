"""Conversations: rows -> messages, and messages -> tokens with a per-token "learn this" mask.

Every template builds a conversation from segments (ids plus a kind: BOS, prompt or assistant output),
so training masks and generation prompts come from the same code and always agree: the tokens of
``prompt(messages[:-1])`` are exactly the start of ``tokenize(messages)``. Templates that are written
here (Llama 3, ChatML) add special tokens by id and encode content as plain text, so a special-token
string inside user data stays text. The Jinja path renders the tokenizer's own template and maps each
piece of text back to the message that added it.
"""

from __future__ import annotations

import bisect
import itertools
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from titanium.config.sections import DataSection
from titanium.data.text import DataError
from titanium.data.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "human": "user",
    "gpt": "assistant",
}

Tools = list[dict[str, Any]]
"""Tool (function) schemas as transformers' apply_chat_template(tools=...) takes them."""


@dataclass(frozen=True)
class Message:
    role: str  # system, user, assistant or tool
    content: str
    extra: Mapping[str, Any] = field(default_factory=dict)
    """The message's other keys as the row holds them (tool_calls, tool_call_id, name...): a tokenizer's Jinja
    template sees them as transformers passes them. A tool-calling answer with a null content keeps
    ``"content": None`` here, so the template sees the null."""

    @property
    def uses_tools(self) -> bool:
        return self.role == "tool" or bool(self.extra.get("tool_calls"))

    def as_dict(self) -> dict[str, Any]:
        """The message as a chat template reads it."""
        return {"role": self.role, "content": self.content, **self.extra}


class RowError(ValueError):
    """A row that is not a usable conversation; the dataset skips it or turns it into a DataError."""


class ChatTemplateError(DataError):
    """A chat template that cannot work with this tokenizer, or a Jinja template we cannot use."""


# ---------------------------------------------------------------------------------------------- rows


def _text_field(value: Any, what: str) -> str:
    if value is None:
        raise RowError(f"{what} is missing or null")
    if not isinstance(value, str):
        raise RowError(f"{what} is {type(value).__name__}, not a string")
    if not value.strip():
        raise RowError(f"{what} is empty")
    return value


def _column(row: Any, column: str) -> Any:
    if not isinstance(row, dict):
        raise RowError(f"the row is {type(row).__name__}, not an object with columns")
    if row.get(column) is None:  # the datasets library fills a column absent from some rows with None
        raise RowError(f"no '{column}' column (columns: {sorted(row)})")
    return row[column]


def check_conversation(messages: list[Message]) -> list[Message]:
    """A conversation we can learn from: a system message only first, and ending with the assistant.

    A trailing user turn has no answer to learn, and a system message in the middle is ambiguous in
    every template, so both are treated as malformed rather than guessed at.
    """
    if not messages:
        raise RowError("no messages")
    if any(m.role == "system" for m in messages[1:]):
        raise RowError("a system message is only allowed as the first message")
    if messages[-1].role != "assistant":
        raise RowError(f"the conversation ends with a {messages[-1].role} message, not an assistant answer")
    return messages


def parse_chat_row(row: Any, cfg: DataSection) -> list[Message]:
    """A row holding a conversation to learn from: a list of {role, content} messages (OpenAI style, or
    ShareGPT's from/value) ending with the assistant."""
    return check_conversation(parse_messages(_column(row, cfg.messages_column), f"'{cfg.messages_column}'", cfg))


def parse_messages(raw: Any, what: str, cfg: DataSection) -> list[Message]:
    """A list of {role, content} messages in any order of roles, keys per --data.role_key /
    --data.content_key; `what` names it in errors. An assistant message with ``tool_calls`` (a list) may have
    an empty or null content; its other keys travel in ``Message.extra``."""
    if not isinstance(raw, list):
        raise RowError(f"{what} is {type(raw).__name__}, not a list of messages")
    messages = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise RowError(f"message {i} is {type(item).__name__}, not an object")
        role = item.get(cfg.role_key)
        if role is None:
            raise RowError(f"message {i} has no '{cfg.role_key}' (keys: {sorted(item)})")
        if not isinstance(role, str) or role not in ROLE_ALIASES:
            raise RowError(f"message {i} has unknown role {role!r} (expected one of {', '.join(ROLE_ALIASES)})")
        extra = {k: v for k, v in item.items() if k not in (cfg.role_key, cfg.content_key)}
        content = item.get(cfg.content_key)
        calls = extra.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise RowError(f"message {i} 'tool_calls' is {type(calls).__name__}, not a list of calls")
        if calls and ROLE_ALIASES[role] == "assistant" and (content is None or content == ""):
            extra, content = ({**extra, "content": None} if content is None else extra), ""
        else:
            content = _text_field(content, f"message {i} '{cfg.content_key}'")
        messages.append(Message(ROLE_ALIASES[role], content, extra))
    return messages


def parse_tools(row: Any, cfg: DataSection) -> Tools | None:
    """The row's --data.tools_column: a list of tool schemas, or that list as a JSON string (as TRL reads it);
    None when the row has none."""
    value = row.get(cfg.tools_column) if isinstance(row, dict) else None
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RowError(f"'{cfg.tools_column}' is a string but not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise RowError(f"'{cfg.tools_column}' is not a list of tool schemas (JSON objects)")
    return value


def parse_instruct_row(row: Any, cfg: DataSection) -> list[Message]:
    """instruction (+ optional input, after a blank line) as the user turn, output as the answer."""
    user = instruct_user_message(row, cfg)
    output = _text_field(row.get(cfg.output_column), f"'{cfg.output_column}'")
    return [user, Message("assistant", output)]


def instruct_user_message(row: Any, cfg: DataSection) -> Message:
    """The user turn of an instruct row: the instruction, then the optional input after a blank line."""
    instruction = _text_field(_column(row, cfg.instruction_column), f"'{cfg.instruction_column}'")
    extra = row.get(cfg.input_column)
    if extra is not None and not isinstance(extra, str):
        raise RowError(f"'{cfg.input_column}' is {type(extra).__name__}, not a string")
    return Message("user", f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction)


def with_system_prompt(messages: list[Message], system_prompt: str | None) -> list[Message]:
    """Replace the conversation's system message with `system_prompt`, or add it in front."""
    if system_prompt is None:
        return messages
    rest = messages[1:] if messages and messages[0].role == "system" else messages
    return [Message("system", system_prompt), *rest]


# ------------------------------------------------------------------------------------------ templates

# The built-in formats as Jinja chat templates, for exports (transformers and vLLM then render what titanium
# trained on; tests/unit/test_chat_templates.py checks each against its format).
CHATML_JINJA = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' "
    "+ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3_JINJA = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# Qwen3's published rule for chats without tools: the last user query's answer opens with a <think> block
# (empty when there is no reasoning), earlier answers do not; enable_thinking=false puts an empty block in the
# generation prompt (the default here: titanium's qwen3 format trains without reasoning). Written here from that
# rule (not copied), in the Jinja dialect of hub templates.
QWEN3_JINJA = """
{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{% endif %}
{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
    {%- elif m.role == 'assistant' %}
        {%- set content = m.content %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if not (enable_thinking is defined and enable_thinking) %}{{- '<think>\n\n</think>\n\n' }}{% endif %}
{%- endif %}
"""


SegmentKind = Literal["bos", "prompt", "output"]
Segment = tuple[list[int], SegmentKind]


class ChatTemplate(ABC):
    """Messages -> tokens. Output (assistant content and its end of turn) is always trainable, BOS never,
    everything else (system, user and tool turns, headers) only with train_on_input."""

    stop_ids: set[int]
    """Ids that end an assistant turn (generation stops at any of them)."""
    jinja: str | None = None
    """The format as a Jinja chat template (what an export writes, so transformers renders what was trained)."""
    renders_tools = False
    """Whether `tools`, tool calls and tool messages can be rendered (only a tokenizer's own template can)."""

    @abstractmethod
    def _segments(self, messages: Sequence[Message], generation: bool, tools: Tools | None) -> list[Segment]:
        """The conversation as segments; with `generation`, followed by the header opening the assistant's turn."""

    def _checked_segments(self, messages: Sequence[Message], generation: bool, tools: Tools | None) -> list[Segment]:
        if not self.renders_tools and (tools or any(m.uses_tools for m in messages)):
            raise RowError(
                "it has tools, tool calls or tool messages, which only a tokenizer's own chat template renders "
                "(--chat.chat_template tokenizer, with a template that supports tools)"
            )
        return self._segments(messages, generation, tools)

    def tokenize(
        self, messages: Sequence[Message], train_on_input: bool, tools: Tools | None = None
    ) -> tuple[list[int], list[bool]]:
        tokens: list[int] = []
        trainable: list[bool] = []
        for ids, kind in self._checked_segments(messages, False, tools):
            tokens.extend(ids)
            trainable.extend([kind == "output" or (kind == "prompt" and train_on_input)] * len(ids))
        return tokens, trainable

    def prompt(self, messages: Sequence[Message], tools: Tools | None = None) -> list[int]:
        """The conversation so far plus the assistant header: what a model continues when it answers."""
        return [i for ids, _ in self._checked_segments(messages, True, tools) for i in ids]


def _require_specials(tokenizer: Tokenizer, names: Sequence[str], template: str) -> dict[str, int]:
    missing = [n for n in names if n not in tokenizer.special_tokens]
    if missing:
        raise ChatTemplateError(
            f"--chat.chat_template {template} needs the special tokens {', '.join(names)}, and the tokenizer "
            f"({tokenizer!r}) lacks {', '.join(missing)}; choose the template that matches the tokenizer "
            "(llama3 for Llama 3 / titanium tokenizers, qwen3 for Qwen3, chatml for other Qwen models) or "
            "'tokenizer' for its own template"
        )
    return {n: tokenizer.special_tokens[n] for n in names}


class _TurnTemplate(ChatTemplate):
    """A format written here: an optional preamble, then a header and a body per message, by id."""

    tokenizer: Tokenizer
    preamble: list[int]  # e.g. BOS

    @abstractmethod
    def _header(self, role: str) -> list[int]: ...

    @abstractmethod
    def _body(self, content: str) -> list[int]:
        """The content and the end of the turn."""

    def _segments(self, messages: Sequence[Message], generation: bool, tools: Tools | None) -> list[Segment]:
        segments: list[Segment] = [(self.preamble, "bos")] if self.preamble else []
        for m in messages:
            body = self._body(m.content)
            segments += [(self._header(m.role), "prompt"), (body, "output" if m.role == "assistant" else "prompt")]
        if generation:
            segments.append((self._header("assistant"), "prompt"))
        return segments

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, bos=False, eos=False)


class Llama3Template(_TurnTemplate):
    """<|begin_of_text|> then <|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|> per message.

    Content is stripped, as Meta's reference chat format and its Hugging Face template do.
    """

    jinja = LLAMA3_JINJA

    def __init__(self, tokenizer: Tokenizer) -> None:
        names = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
        self.tokenizer = tokenizer
        bos, self.start, self.end, self.eot = _require_specials(tokenizer, names, "llama3").values()
        self.preamble = [bos]
        self.stop_ids = {self.eot, tokenizer.eos_id}

    def _header(self, role: str) -> list[int]:
        return [self.start, *self._encode(role), self.end, *self._encode("\n\n")]

    def _body(self, content: str) -> list[int]:
        return [*self._encode(content.strip()), self.eot]


class ChatMLTemplate(_TurnTemplate):
    """<|im_start|>role\\ncontent<|im_end|>\\n per message (Qwen); no BOS. The newline after <|im_end|>
    belongs to the turn, so it is learned with the answer."""

    name = "chatml"
    jinja = CHATML_JINJA

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.start, self.end = _require_specials(tokenizer, ("<|im_start|>", "<|im_end|>"), self.name).values()
        self.preamble = []
        self.stop_ids = {self.end, tokenizer.eos_id}

    def _header(self, role: str) -> list[int]:
        return [self.start, *self._encode(f"{role}\n")]

    def _body(self, content: str) -> list[int]:
        return [*self._encode(content), self.end, *self._encode("\n")]


class Qwen3Template(ChatMLTemplate):
    """ChatML as Qwen3's own template renders a chat without reasoning, so the model trains in the format it
    is served with (``enable_thinking=False``).

    The answer to the last user query opens with an empty ``<think>\\n\\n</think>\\n\\n`` block (and loses
    its leading newlines); earlier answers have none. The block belongs to the prompt, as in Qwen3's
    generation prompt with thinking off: the model never writes it, so it is not learned.
    """

    name = "qwen3"
    jinja = QWEN3_JINJA

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        self.empty_thinking = self._encode("<think>\n\n</think>\n\n")

    def _segments(self, messages: Sequence[Message], generation: bool, tools: Tools | None) -> list[Segment]:
        if any(m.role == "assistant" and "</think>" in m.content for m in messages):
            raise RowError(
                "an assistant message holds a </think> reasoning block, which Qwen3's template would move; "
                "the qwen3 template trains chats without reasoning (use --chat.chat_template tokenizer)"
            )
        segments = super()._segments(messages, False, tools)
        last = messages[-1] if messages else None
        if last is not None and last.role == "assistant" and any(m.role == "user" for m in messages):
            answer = self._body(last.content.lstrip("\n"))
            segments[-1:] = [(self.empty_thinking, "prompt"), (answer, "output")]
        if generation:
            segments += [(self._header("assistant"), "prompt"), (self.empty_thinking, "prompt")]
        return segments


class SpecialTextEncoder:
    """Text -> ids with the tokenizer's control-token strings (specials that ``encode`` keeps as text, so that data
    can never inject them) turned into their ids: how a Hugging Face tokenizer reads rendered chat text."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.control = {
            n: i for n, i in tokenizer.special_tokens.items() if tokenizer.encode(n, bos=False, eos=False) != [i]
        }
        pattern = "|".join(re.escape(n) for n in sorted(self.control, key=len, reverse=True))
        self.split = re.compile(f"({pattern})") if pattern else None

    def encode(self, text: str) -> list[int]:
        parts = self.split.split(text) if self.split else [text]
        ids: list[int] = []
        for k, part in enumerate(parts):
            if k % 2:
                ids.append(self.control[part])
            elif part:
                ids.extend(self.tokenizer.encode(part, bos=False, eos=False))
        return ids


class JinjaTemplate(ChatTemplate):
    """A Hugging Face tokenizer's own Jinja ``chat_template``, rendered in a sandbox.

    Masks come from rendering growing prefixes: for an assistant message i, the text that ``messages[:i+1]``
    adds to the generation prompt of ``messages[:i]`` is its answer, and what that generation prompt adds to
    ``messages[:i]`` its (untrained) header; the text between two answers (user turns, tool calls' results,
    with the row's ``tools`` rendered where the template puts them) is prompt. Each piece is tokenized on its
    own, so the answer starts on a token boundary exactly as it does when the model generates after
    ``prompt()``. Templates whose earlier text changes as the conversation grows (e.g. ones that drop past
    reasoning) break this and are refused with an error; choose llama3, qwen3 or chatml for them. A
    conversation the template itself rejects (its ``raise_exception``, e.g. roles that do not alternate) is
    that row's fault: a RowError.
    """

    renders_tools = True

    def __init__(self, tokenizer: Tokenizer, source: str) -> None:
        from jinja2 import TemplateError

        from titanium.data.jinja_env import chat_template_environment

        try:
            self._template = chat_template_environment().from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"the tokenizer's chat_template is not valid Jinja: {e}") from None
        self.tokenizer, self.jinja = tokenizer, source
        id_to_name = {i: n for n, i in tokenizer.special_tokens.items()}
        bos, eos = id_to_name.get(tokenizer.bos_id, ""), id_to_name.get(tokenizer.eos_id, "")
        self._names = {"bos_token": bos, "eos_token": eos}
        self._specials = SpecialTextEncoder(tokenizer)
        self._control, self._split = self._specials.control, self._specials.split
        probe = [Message("user", "x"), Message("assistant", "y")]
        self._closing = ""
        try:
            self._closing = self._closing_text(probe[:1])
            answer = [ids for ids, kind in self._segments(probe, False, None) if kind == "output"][-1]
        except RowError as e:  # it rejects the simplest conversation: the template, not a row, is at fault
            raise ChatTemplateError(
                f"the tokenizer's chat_template cannot render a plain user/assistant conversation ({e}); "
                "set --chat.chat_template llama3, qwen3 or chatml"
            ) from None
        self.stop_ids = {tokenizer.eos_id} | {i for i in answer if i in self._control.values()}

    def _closing_text(self, messages: Sequence[Message]) -> str:
        """What the template writes after the last message only when no generation prompt follows (Phi-3 ends a
        conversation with its EOS token): cut from a conversation's rendering where the next message follows."""
        closed, opened = self._render(messages, False, None), self._render(messages, True, None)
        cut = next((n for n in range(len(closed), 0, -1) if opened.startswith(closed[:n])), len(closed))
        for token in self._split.finditer(closed) if self._split else ():  # (never inside a control token)
            if token.start() < cut < token.end():
                cut = token.start()
        return closed[cut:]

    def _open_render(self, messages: Sequence[Message], tools: Tools | None) -> str:
        """``messages`` rendered as the start of a longer conversation (without the closing text)."""
        text = self._render(messages, False, tools)
        return text[: len(text) - len(self._closing)] if self._closing and text.endswith(self._closing) else text

    def _render(self, messages: Sequence[Message], generation: bool, tools: Tools | None) -> str:
        from jinja2 import TemplateError

        dicts = [m.as_dict() for m in messages]
        try:
            return self._template.render(messages=dicts, tools=tools, add_generation_prompt=generation, **self._names)
        except TemplateError as e:  # raise_exception() on this conversation (roles not alternating, ...)
            raise RowError(f"the tokenizer's chat_template rejected it: {e}") from None

    def conversation_ids(self, messages: Sequence[Message]) -> list[int]:
        """The whole conversation rendered once and its text encoded whole, as transformers' ``apply_chat_template``
        then the tokenizer (``add_special_tokens=False``) make it: no cuts between messages (for scoring a
        conversation, e.g. by a reward model with its own template; training uses ``tokenize``)."""
        return self._encode(self._render(messages, False, None), at_start=True)

    def _encode(self, text: str, *, at_start: bool) -> list[int]:
        """Rendered text -> ids, with the template's control-token strings turned into their ids; a piece that does
        not start the conversation is encoded as it is after them (a Hugging Face tokenizer does both itself, as
        transformers does)."""
        encode_rendered = getattr(self.tokenizer, "encode_rendered", None)
        if encode_rendered is not None:
            return encode_rendered(text, at_start=at_start)
        return self._specials.encode(text)

    def _encode_pieces(self, pieces: list[tuple[str, SegmentKind]]) -> list[Segment]:
        """The pieces' ids. A Hugging Face tokenizer encodes the whole text once, as ``apply_chat_template`` does,
        and it is cut where the pieces meet; where a token crosses a cut (Qwen's ``"\n\n"`` when an answer starts
        with a newline) each piece is encoded on its own instead, so the answer starts on a token boundary as it
        does when the model writes it after ``prompt()``."""
        encode_with_offsets = getattr(self.tokenizer, "encode_rendered_offsets", None)
        if encode_with_offsets is not None and pieces:
            ids, offsets = encode_with_offsets("".join(text for text, _ in pieces))
            cuts = list(itertools.accumulate(len(text) for text, _ in pieces))
            owners = [min(bisect.bisect_right(cuts, start), len(pieces) - 1) for start, _ in offsets]
            if all(end <= cuts[owner] for owner, (_, end) in zip(owners, offsets)):
                segments: list[Segment] = [([], kind) for _, kind in pieces]
                for owner, token in zip(owners, ids):
                    segments[owner][0].append(token)
                return [segment for segment in segments if segment[0]]
        return [(self._encode(text, at_start=k == 0), kind) for k, (text, kind) in enumerate(pieces)]

    def _delta(self, before: str, after: str) -> str:
        if not after.startswith(before):
            raise ChatTemplateError(
                "the tokenizer's chat_template renders earlier messages differently as the conversation grows, "
                "so per-message loss masks cannot be derived from it; set --chat.chat_template llama3, qwen3 or "
                "chatml"
            )
        return after[len(before) :]

    def _segments(self, messages: Sequence[Message], generation: bool, tools: Tools | None) -> list[Segment]:
        if self._split is not None:  # (tool calls and schemas are rendered too, as JSON)
            texts = [(f"a {m.role} message", f"{m.content} {json.dumps(m.extra, default=str)}") for m in messages]
            for what, text in [*texts, ("the tools column", json.dumps(tools, default=str))]:
                found = self._split.search(text)
                if found:
                    raise RowError(f"{what} contains the control token {found.group()!r} as text")
        pieces: list[tuple[str, SegmentKind]] = []
        text = ""  # what the pieces so far render

        def extend(upto: str, kind: SegmentKind) -> None:
            nonlocal text
            piece = self._delta(text, upto)
            if piece:
                pieces.append((piece, kind))
            text = upto

        # Cut only where the mask changes: before an assistant's header, after it, and after its answer. The
        # messages between two answers (user turns, tool results) are one piece, as a template may render a run
        # of them together (Qwen's groups consecutive tool results in one turn).
        for i, m in enumerate(messages):
            if m.role == "assistant":
                if i:
                    extend(self._open_render(messages[:i], tools), "prompt")
                extend(self._render(messages[:i], True, tools), "prompt")
                extend(self._open_render(messages[: i + 1], tools), "output")
        extend(self._render(messages, generation, tools), "prompt")
        segments = self._encode_pieces(pieces)
        if segments and segments[0][0][:1] == [self.tokenizer.bos_id]:
            first, kind = segments[0]
            segments[0:1] = [([first[0]], "bos"), (first[1:], kind)]
        return segments


def build_chat_template(name: str, tokenizer: Tokenizer, family_format: str = "") -> ChatTemplate:
    """--chat.chat_template: llama3, chatml, qwen3, tokenizer (its Jinja template) or auto (that, else
    ``family_format``: the format the model family registers for its instruct models, "" if none; the loop hands it
    over from the model spec, as data never imports models)."""
    source = getattr(tokenizer, "chat_template", None)
    if name == "auto":
        name = "tokenizer" if source else family_format
        if not name:
            raise ChatTemplateError(
                "--chat.chat_template auto: the tokenizer has no chat_template and the model family has no "
                "default format; set --chat.chat_template llama3, qwen3 or chatml"
            )
    if name == "llama3":
        return Llama3Template(tokenizer)
    if name == "chatml":
        return ChatMLTemplate(tokenizer)
    if name == "qwen3":
        return Qwen3Template(tokenizer)
    if name == "none":
        raise ChatTemplateError(
            "--chat.chat_template none (plain text, no template) is for SFT and DPO data; this needs a template: "
            "set auto, tokenizer, llama3, qwen3 or chatml"
        )
    if name == "tokenizer":
        if not source:
            raise ChatTemplateError(
                f"--chat.chat_template tokenizer: {tokenizer!r} has no chat_template (a Hugging Face "
                "tokenizer_config.json 'chat_template' or a chat_template.jinja file); "
                "set --chat.chat_template llama3, qwen3 or chatml"
            )
        return JinjaTemplate(tokenizer, source)
    raise ChatTemplateError(
        f"unknown --chat.chat_template {name!r}; expected auto, llama3, chatml, qwen3, tokenizer or none"
    )


def build_optional_chat_template(name: str, tokenizer: Tokenizer, family_format: str = "") -> ChatTemplate | None:
    """As build_chat_template, for the data that may be plain text (SFT, DPO): none is no template."""
    return None if name == "none" else build_chat_template(name, tokenizer, family_format)


def trained_chat_template(name: str, tokenizer: Tokenizer, family_format: str = "") -> str | None:
    """The Jinja text of the chat format a run with ``--chat.chat_template name`` trained on (the tokenizer's own
    with ``none``, when it has one): what its exports carry. None when there is none."""
    if name == "none":
        return getattr(tokenizer, "chat_template", None)
    try:
        return build_chat_template(name, tokenizer, family_format).jinja
    except ChatTemplateError:
        return None
