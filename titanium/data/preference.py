"""Preference pairs: rows -> a shared prompt with a chosen and a rejected response -> two fine-tuning samples.

Rows come in the common public shapes (column names per --data.prompt_column, chosen_column,
rejected_column):

- ``prompt``, ``chosen``, ``rejected`` strings: one user turn and two assistant answers;
- ``prompt`` a message list, ``chosen``/``rejected`` strings or message lists (the answer's turns);
- ``chosen``/``rejected`` whole conversations: with a ``prompt`` column they start with its messages
  (UltraFeedback-binarized), without one their shared first messages are the prompt (Anthropic-HH).

Each side is rendered by the SFT chat template as prompt + response (with the row's tools, --data.tools_column),
so a pair's two samples share their prompt tokens exactly, and only response tokens carry labels (IGNORE_INDEX
on the prompt, even on its earlier assistant turns). Without a template (--chat.chat_template none, base
models) rows of strings are plain text as TRL's DPOTrainer tokenizes them (titanium.data.completion):
BOS + prompt, and BOS + prompt + response + EOS, each response starting where its ids leave the prompt's.
--dpo.max_prompt_length keeps the last tokens of a longer prompt, as TRL's option did. Rows are streamed,
split over data-parallel ranks, counted when bad and resumed exactly by the same RowReader as SFT samples.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from titanium.config.sections import DataSection
from titanium.data.chat import (
    ChatTemplate,
    ChatTemplateError,
    Message,
    RowError,
    Tools,
    _text_field,
    check_conversation,
    parse_tools,
    with_system_prompt,
)
from titanium.data.completion import NeedsTemplate, common_prefix_length, messages_of, plain_text
from titanium.data.sft import IGNORE_INDEX, Sample, shifted_labels
from titanium.data.text import DataError, RowReader, Source
from titanium.data.tokenizer import Tokenizer

Response = tuple[list[int], list[bool]]
"""A response's token ids (after the shared prompt) and which of them carry loss."""

_FIX = "fix the row, or point --data.prompt_column, --data.chosen_column and --data.rejected_column at its columns"


@dataclass
class PreferencePair:
    """One pair as two samples of at most seq_len tokens; ``source``/``row`` say where it came from."""

    chosen: Sample
    rejected: Sample
    source: int
    row: int
    reference: tuple[float, float] | None = None
    """The reference policy's summed log-probs of (chosen, rejected), when read from a precomputed cache."""

    def to_json(self) -> dict[str, Any]:
        d = {"chosen": self.chosen, "rejected": self.rejected, "source": self.source, "row": self.row}
        return d if self.reference is None else {**d, "reference": list(self.reference)}

    @staticmethod
    def from_json(d: dict[str, Any]) -> PreferencePair:
        ref = d.get("reference")
        reference = None if ref is None else (float(ref[0]), float(ref[1]))
        return PreferencePair(dict(d["chosen"]), dict(d["rejected"]), d["source"], d["row"], reference)


# ---------------------------------------------------------------------------------------------- rows


def _messages(row: dict, column: str, string_role: str, cfg: DataSection) -> list[Message] | None:
    """A column as messages: a string is one `string_role` message; None when the column is absent or null."""
    value = row.get(column)
    if value is None:
        return None
    if isinstance(value, str):
        return [Message(string_role, _text_field(value, f"'{column}'"))]
    return messages_of(value, column, cfg)


def _response(row: dict, column: str, cfg: DataSection) -> list[Message]:
    messages = _messages(row, column, "assistant", cfg)
    if messages is None:
        raise RowError(f"no '{column}' column (columns: {sorted(row)})")
    return messages


def _shared_prefix(a: list[Message], b: list[Message]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def parse_preference_row(row: Any, cfg: DataSection) -> tuple[list[Message], list[Message], list[Message]]:
    """(prompt, chosen continuation, rejected continuation); each continuation starts and ends with the assistant."""
    if not isinstance(row, dict):
        raise RowError(f"the row is {type(row).__name__}, not an object with columns")
    chosen, rejected = _response(row, cfg.chosen_column, cfg), _response(row, cfg.rejected_column, cfg)
    prompt = _messages(row, cfg.prompt_column, "user", cfg)
    if prompt is None:
        n = _shared_prefix(chosen, rejected)
        if chosen == rejected:
            raise RowError(f"'{cfg.chosen_column}' and '{cfg.rejected_column}' are the same conversation")
        if n == 0:
            raise RowError(
                f"no '{cfg.prompt_column}' column, and '{cfg.chosen_column}' and '{cfg.rejected_column}' do not "
                "start with the same messages (whole conversations sharing their prompt)"
            )
        prompt = chosen[:n]
    for name, side in ((cfg.chosen_column, chosen), (cfg.rejected_column, rejected)):
        if side[: len(prompt)] == prompt:  # a whole conversation repeating the prompt: keep what follows
            side[: len(prompt)] = []
        if not side:
            raise RowError(f"'{name}' has no response after the prompt")
        if side[0].role != "assistant":
            raise RowError(
                f"'{name}' continues the prompt with a {side[0].role} message, not an assistant answer "
                "(a whole conversation must start with exactly the prompt's messages)"
            )
    if chosen == rejected:
        raise RowError(f"'{cfg.chosen_column}' and '{cfg.rejected_column}' are the same response")
    check_conversation(prompt + chosen)
    check_conversation(prompt + rejected)
    return prompt, chosen, rejected


def parse_text_preference_row(row: Any, cfg: DataSection) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) strings of a plain-text row; NeedsTemplate for a row of messages."""
    if not isinstance(row, dict):
        raise RowError(f"the row is {type(row).__name__}, not an object with columns")
    columns = (cfg.prompt_column, cfg.chosen_column, cfg.rejected_column)
    if any(isinstance(row.get(c), list) for c in columns):
        raise NeedsTemplate(f"'{cfg.prompt_column}', '{cfg.chosen_column}' or '{cfg.rejected_column}' holds messages")
    prompt, chosen, rejected = (_text_field(row.get(c), f"'{c}'") for c in columns)
    if chosen == rejected:
        raise RowError(f"'{cfg.chosen_column}' and '{cfg.rejected_column}' are the same response")
    return prompt, chosen, rejected


# ------------------------------------------------------------------------------------------- tokens


def tokenize_text_pair(
    tokenizer: Tokenizer, prompt: str, chosen: str, rejected: str
) -> tuple[list[int], Response, Response]:
    """TRL's plain-text pair: the responses start where BOS + prompt + response + EOS first differs from BOS +
    prompt (for either side), and every response token carries loss."""
    prompt_ids = plain_text(tokenizer, prompt, eos=False)
    sides = [plain_text(tokenizer, prompt + side, eos=True) for side in (chosen, rejected)]
    n = min(common_prefix_length(prompt_ids, ids) for ids in sides)
    responses = [(ids[n:], [True] * (len(ids) - n)) for ids in sides]
    return prompt_ids[:n], responses[0], responses[1]


def tokenize_pair(
    template: ChatTemplate,
    prompt: list[Message],
    chosen: list[Message],
    rejected: list[Message],
    tools: Tools | None = None,
) -> tuple[list[int], Response, Response]:
    """Shared prompt ids (through the assistant header) and each response's ids and loss mask.

    The loss mask keeps the template's own mask (assistant content and end of turn; not the headers or user
    turns of a multi-turn response), and nothing of the prompt: its earlier assistant turns are context.
    """
    prompt_ids = template.prompt(prompt, tools)
    return (
        prompt_ids,
        tokenize_response(template, prompt, prompt_ids, chosen, tools),
        tokenize_response(template, prompt, prompt_ids, rejected, tools),
    )


def tokenize_response(
    template: ChatTemplate,
    prompt: list[Message],
    prompt_ids: list[int],
    response: list[Message],
    tools: Tools | None = None,
) -> Response:
    """A response's ids after ``prompt_ids`` (the prompt through the assistant header) and its loss mask."""
    tokens, trainable = template.tokenize([*prompt, *response], train_on_input=False, tools=tools)
    if tokens[: len(prompt_ids)] != prompt_ids:
        raise ChatTemplateError(
            "the chat template renders a prompt differently when a response follows it, so the prompt of a "
            "preference row cannot be found; choose the llama3 or chatml chat template"
        )
    return tokens[len(prompt_ids) :], trainable[len(prompt_ids) :]


def fit_pair(
    prompt: list[int], chosen: Response, rejected: Response, seq_len: int, bos_id: int | None
) -> tuple[list[int], Response, Response]:
    """Cut a pair so that prompt + each response fits seq_len, keeping the two sides comparable.

    The prompt goes first: its start is dropped (a leading BOS stays), keeping its end, which is what the
    responses answer, but never below half of seq_len. If that is not enough, both responses are cut to the
    same length from their end.
    """
    longest = max(len(chosen[0]), len(rejected[0]))
    if len(prompt) + longest <= seq_len:
        return prompt, chosen, rejected
    keep = max(seq_len - longest, min(len(prompt), seq_len // 2))
    if keep < len(prompt):
        head = prompt[:1] if prompt and prompt[0] == bos_id and keep > 1 else []
        prompt = head + prompt[len(prompt) - (keep - len(head)) :]
    room = seq_len - len(prompt)
    return prompt, (chosen[0][:room], chosen[1][:room]), (rejected[0][:room], rejected[1][:room])


def pair_sample(prompt: list[int], response: Response) -> Sample:
    """prompt + response with labels shifted inside the sample; only response tokens are targets."""
    tokens = prompt + response[0]
    return {"tokens": tokens, "labels": shifted_labels(tokens, [False] * len(prompt) + response[1])}


def has_target(sample: Sample) -> bool:
    return any(label != IGNORE_INDEX for label in sample["labels"])


class PreferenceDataset(RowReader):
    """Infinite, resumable stream of PreferencePairs (each side at most `seq_len` tokens) for one DP rank.

    `template` None (--chat.chat_template none) reads rows of strings as plain text with `tokenizer`.
    Counters (kept in the state): ``bad_rows`` (skipped, see RowReader), ``truncated`` (pairs cut to fit
    seq_len), ``dropped`` (pairs too long with on_long_pair=drop, ``long_dropped`` of them, or left without a
    target or a difference between the two sides by the cut), ``prompt_truncated`` (prompts cut to
    `max_prompt_length`).
    """

    def __init__(
        self,
        data: DataSection,
        template: ChatTemplate | None,
        seq_len: int,
        bos_id: int | None,
        system_prompt: str | None = None,
        on_long_pair: Literal["truncate", "drop"] = "truncate",
        dp_rank: int = 0,
        dp_world: int = 1,
        *,
        tokenizer: Tokenizer | None = None,
        max_prompt_length: int = 0,
    ) -> None:
        if data.kind != "preference":
            raise DataError(f"--data.kind {data.kind} has no preference pairs; use --data.kind preference")
        if template is None and tokenizer is None:
            raise ValueError("plain-text pairs (no chat template) need the tokenizer")
        super().__init__(data, dp_rank, dp_world)
        self.template, self.tokenizer, self.seq_len, self.bos_id = template, tokenizer, seq_len, bos_id
        self.system_prompt, self.on_long_pair, self.max_prompt_length = system_prompt, on_long_pair, max_prompt_length
        self.truncated = 0
        self.dropped = 0
        self.long_dropped = 0
        self.prompt_truncated = 0

    def _tokenize(self, item: Any, source: Source, row: int) -> tuple[list[int], Response, Response] | None:
        try:
            if self.template is None:
                assert self.tokenizer is not None
                return tokenize_text_pair(self.tokenizer, *parse_text_preference_row(item, self.cfg))
            prompt, chosen, rejected = parse_preference_row(item, self.cfg)
            prompt = with_system_prompt(prompt, self.system_prompt)
            return tokenize_pair(self.template, prompt, chosen, rejected, parse_tools(item, self.cfg))
        except NeedsTemplate as e:
            raise e.error(source, row) from None
        except RowError as e:
            self._bad_row(source, row, str(e), _FIX)
            return None

    def _pair(
        self, prompt: list[int], chosen: Response, rejected: Response, source: int, row: int
    ) -> PreferencePair | None:
        """Cut the prompt to max_prompt_length, fit the pair to seq_len per on_long_pair; None (counted) when it
        cannot be used."""
        if self.max_prompt_length and len(prompt) > self.max_prompt_length:
            prompt = prompt[-self.max_prompt_length :]
            self.prompt_truncated += 1
        too_long = len(prompt) + max(len(chosen[0]), len(rejected[0])) > self.seq_len
        if too_long and self.on_long_pair == "drop":
            self.dropped += 1
            self.long_dropped += 1
            return None
        prompt, chosen, rejected = fit_pair(prompt, chosen, rejected, self.seq_len, self.bos_id)
        pair = PreferencePair(pair_sample(prompt, chosen), pair_sample(prompt, rejected), source, row)
        if not (has_target(pair.chosen) and has_target(pair.rejected)) or pair.chosen == pair.rejected:
            self.dropped += 1
            return None
        self.truncated += too_long
        return pair

    def __iter__(self) -> Iterator[PreferencePair]:
        for source, row, item in self._rows():
            tokenized = self._tokenize(item, source, row)
            pair = self._pair(*tokenized, self.source_idx, row) if tokenized is not None else None
            if pair is not None:
                self._pass_used = True
                yield pair

    def _unused_rows(self) -> list[str]:
        reasons = super()._unused_rows()
        if self.long_dropped:
            reasons.append(
                f"{self.long_dropped} pairs longer than --training.seq_len {self.seq_len} dropped: raise it, or set "
                "--dpo.on_long_pair truncate"
            )
        if self.dropped > self.long_dropped:
            reasons.append(
                f"{self.dropped - self.long_dropped} pairs left without a response or a difference between the two "
                f"once cut to --training.seq_len {self.seq_len}: raise it"
            )
        return reasons

    def state_dict(self) -> dict[str, Any]:
        counters = {"truncated": self.truncated, "dropped": self.dropped, "long_dropped": self.long_dropped}
        return {**self._position(), **counters, "prompt_truncated": self.prompt_truncated}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_position(state)
        self.truncated, self.dropped = state["truncated"], state["dropped"]
        self.long_dropped = state.get("long_dropped", 0)  # (not in checkpoints saved before it was counted)
        self.prompt_truncated = state.get("prompt_truncated", 0)  # (nor this)


class OnePass:
    """The first ``limit`` pairs (all by default) of one pass over a PreferenceDataset, from its start: a
    pair stream for passes outside training (precomputing reference log-probs, evaluation), never resumed."""

    def __init__(self, pairs: PreferenceDataset, limit: int | None = None) -> None:
        self.pairs, self.limit = pairs, limit

    def __iter__(self) -> Iterator[PreferencePair]:
        for n, pair in enumerate(self.pairs):
            if self.pairs.epoch or n == self.limit:
                return
            yield pair

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise AssertionError("a single pass is not resumed")
