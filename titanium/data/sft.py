"""Fine-tuning samples: rows -> (tokens, labels shifted inside the sample, prompt tokens masked).

Each row becomes one sample, streamed (the dataset is never loaded whole), split over data-parallel
ranks and resumable exactly like the pretraining text stream. Labels are shifted here, per sample,
so the sample's last position has no target and packing several samples into one row can never
make a token predict the next sample's first token.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from titanium.config.sections import DataSection, SFTSection
from titanium.data.chat import (
    ChatTemplate,
    Message,
    RowError,
    parse_chat_row,
    parse_instruct_row,
    parse_tools,
    with_system_prompt,
)
from titanium.data.completion import NeedsTemplate, cut_prompt, is_prompt_completion, prompt_completion_tokens
from titanium.data.text import DataError, RowReader, Source
from titanium.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # the loss's ignore label (titanium.objectives.base.IGNORE_INDEX; data does not import trainers)

Sample = dict[str, list[int]]

ROW_FIX = {
    "chat": "fix the row, or point --data.messages_column, --data.role_key and --data.content_key (or "
    "--data.prompt_column and --data.completion_column) at its columns",
    "instruct": "fix the row, or point --data.instruction_column, --data.input_column and --data.output_column "
    "at its columns",
}


def shifted_labels(tokens: list[int], trainable: list[bool]) -> list[int]:
    """labels[i] = tokens[i + 1] where that token is learned, else IGNORE_INDEX; the last is IGNORE_INDEX."""
    labels = [t if keep else IGNORE_INDEX for t, keep in zip(tokens[1:], trainable[1:])]
    return [*labels, IGNORE_INDEX]


class SFTDataset(RowReader):
    """Infinite, resumable stream of {"tokens", "labels"} samples (lists of at most `seq_len` ints) for one DP rank.

    kind chat / instruct: a conversation through the chat template, or (kind chat, a row with a prompt) TRL's
    prompt/completion row (titanium.data.completion), where `template` may be None for rows of strings. kind
    text: a completion sample, BOS + text + EOS, all learned. Counters (kept in the state): ``bad_rows``
    (skipped), ``truncated`` (cut to seq_len), ``dropped`` (too long with on_long_sample=drop, or nothing left
    to learn), ``prompt_truncated`` (prompts cut to --sft.max_prompt_length).
    """

    def __init__(
        self,
        data: DataSection,
        sft: SFTSection,
        tokenizer: Tokenizer,
        template: ChatTemplate | None,
        seq_len: int,
        dp_rank: int = 0,
        dp_world: int = 1,
        system_prompt: str | None = None,
    ) -> None:
        if data.kind not in ("chat", "instruct", "text"):
            raise DataError(f"--data.kind {data.kind} has no fine-tuning samples; use chat, instruct or text")
        if data.kind == "instruct" and template is None:
            raise DataError("--data.kind instruct needs a chat template; --chat.chat_template none has none")
        super().__init__(data, dp_rank, dp_world)
        self.sft, self.tokenizer, self.template, self.seq_len = sft, tokenizer, template, seq_len
        self.system_prompt = system_prompt
        self.truncated = 0
        self.dropped = 0
        self.prompt_truncated = 0
        self._warned: set[str] = set()  # kinds of long sample already shown with an example row

    def _messages(self, item: Any) -> list[Message]:
        parse = parse_chat_row if self.cfg.kind == "chat" else parse_instruct_row
        return with_system_prompt(parse(item, self.cfg), self.system_prompt)

    def _tokenize(self, item: Any, source: Source, row: int) -> tuple[list[int], list[bool]] | None:
        if self.cfg.kind == "text":
            text = self._text_of(item, source, row)
            if text is None:
                return None
            tokens = self.tokenizer.encode(text, bos=True, eos=True)
            return tokens, [True] * len(tokens)
        try:
            if self.cfg.kind == "chat" and is_prompt_completion(item, self.cfg):
                return self._prompt_completion(item)
            if self.template is None:
                raise NeedsTemplate(f"'{self.cfg.messages_column}' holds messages")
            return self.template.tokenize(self._messages(item), self.sft.train_on_input, parse_tools(item, self.cfg))
        except NeedsTemplate as e:
            raise e.error(source, row) from None
        except RowError as e:
            self._bad_row(source, row, str(e), ROW_FIX[self.cfg.kind])
            return None

    def _prompt_completion(self, item: dict) -> tuple[list[int], list[bool]]:
        """Loss on the completion only (on every token with --sft.train_on_input), the prompt cut from the left
        to --sft.max_prompt_length."""
        tokens, prompt_len = prompt_completion_tokens(item, self.cfg, self.tokenizer, self.template, self.system_prompt)
        kept, kept_prompt = cut_prompt(tokens, prompt_len, self.sft.max_prompt_length)
        self.prompt_truncated += kept_prompt < prompt_len
        return kept, [self.sft.train_on_input] * kept_prompt + [True] * (len(kept) - kept_prompt)

    def _warn_once(self, kind: str, source: Source, row: int, what: str) -> None:
        """Show the first truncated (or dropped) sample with its row; the rest only count on the log line."""
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("%s: %s; further ones are counted as '%s' on the log line", source.where(row), what, kind)

    def _sample(self, tokens: list[int], trainable: list[bool], source: Source, row: int) -> Sample | None:
        """Fit the sample to seq_len per --sft.on_long_sample; None (counted) when nothing is left to learn."""
        n, seq_len = len(tokens), self.seq_len
        too_long = n > seq_len
        too_long_text = f"a sample of {n} tokens is longer than --training.seq_len {seq_len}"
        if too_long and self.sft.on_long_sample == "drop":
            self.dropped += 1
            self._warn_once("dropped", source, row, f"{too_long_text}; dropped (--sft.on_long_sample drop)")
            return None
        kept = tokens[:seq_len]
        labels = shifted_labels(kept, trainable[:seq_len])
        if all(label == IGNORE_INDEX for label in labels):
            self.dropped += 1
            prompt = trainable.index(True, 1) if True in trainable[1:] else n  # tokens before the first learned one
            what = f"the prompt alone is {prompt} tokens, nothing to learn within --training.seq_len {seq_len}"
            self._warn_once("dropped", source, row, f"{what}; dropped (raise --training.seq_len)")
            return None
        if too_long:
            self.truncated += 1
            what = f"{too_long_text}; cut to {seq_len} tokens (--sft.on_long_sample drop leaves such samples out)"
            self._warn_once("truncated", source, row, what)
        return {"tokens": kept, "labels": labels}

    def __iter__(self) -> Iterator[Sample]:
        for source, row, item in self._rows():
            tokenized = self._tokenize(item, source, row)
            sample = self._sample(*tokenized, source, row) if tokenized is not None else None
            if sample is not None:
                self._pass_used = True
                yield sample

    def state_dict(self) -> dict[str, Any]:
        counters = {"truncated": self.truncated, "dropped": self.dropped, "prompt_truncated": self.prompt_truncated}
        return {**self._position(), **counters}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_position(state)
        self.truncated, self.dropped = state["truncated"], state["dropped"]
        self.prompt_truncated = state.get("prompt_truncated", 0)  # (not in checkpoints saved before it was counted)
