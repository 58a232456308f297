"""python -m titanium.tools.generate --chat: one multi-turn conversation rendered by the tokenizer's own chat template
(a tiny byte-level BPE with a ChatML Jinja template), each reply the engine's greedy continuation of the whole
conversation so far; turns from --prompt or from stdin, one line each."""

from __future__ import annotations

import dataclasses
import io
import sys
from pathlib import Path

import pytest
import torch

from tests.unit.test_chat_templates import make_hf_tokenizer
from titanium.checkpoint.hf import save_hf_weights
from titanium.data.chat import JinjaTemplate, Message
from titanium.generation.generate import generate
from titanium.generation.sampling import SamplingParams
from titanium.models.llama3 import LLAMA3_FLAVORS, Transformer
from titanium.models.llama3.hf import LLAMA3_HF_ADAPTER
from titanium.tools import generate as generate_tool
from titanium.tools.generate import main

TURNS = ["what is the answer", "hello world"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> tuple[Path, Transformer]:
    out = tmp_path_factory.mktemp("chat") / "model"
    tokenizer = make_hf_tokenizer(out)  # tokenizer.json + tokenizer_config.json (chat_template) in the model folder
    args = dataclasses.replace(
        LLAMA3_FLAVORS["debugmodel"], n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=tokenizer.vocab_size
    )
    model = Transformer(args)
    torch.manual_seed(0)
    model.init_weights()
    save_hf_weights(model.state_dict(), out, LLAMA3_HF_ADAPTER, args)
    return out, model.eval()


def _expected(folder: Path, model: Transformer, turns: list[str]) -> tuple[list[list[int]], list[str]]:
    """Each turn's prompt, the template's rendering of the conversation up to that user turn, and its reply, the
    greedy generation on it."""
    tokenizer = make_hf_tokenizer(folder)
    template = JinjaTemplate(tokenizer, tokenizer.chat_template)
    messages: list[Message] = [Message("system", "Be brief.")]
    prompts, replies = [], []
    for turn in turns:
        messages.append(Message("user", turn))
        prompts.append(template.prompt(messages))
        out = generate(model, prompts[-1:], SamplingParams(6, 0.0), template.stop_ids, tokenizer.pad_id)
        replies.append(tokenizer.decode(out.token_lists()[0]))
        messages.append(Message("assistant", replies[-1]))
    return prompts, replies


def test_chat_turns_from_prompts_and_stdin(folder, capsys, monkeypatch) -> None:
    path, model = folder
    prompts, expected = _expected(path, model, TURNS)
    assert expected[0] and expected[1]  # (a random model still says something in 6 tokens)
    common = [str(path), "--chat", "--max-new-tokens", "6", "--system-prompt", "Be brief.", "--device", "cpu"]
    seen: list[list[int]] = []

    def recording(model, batch, *args, **kwargs):
        seen.extend(list(row) for row in batch)
        return generate(model, batch, *args, **kwargs)

    monkeypatch.setattr(generate_tool, "generate", recording)
    assert main([*common, "--prompt", TURNS[0], "--prompt", TURNS[1]]) == 0
    from_prompts = capsys.readouterr().out
    assert seen == prompts  # the second turn sees the first turn and its reply
    assert from_prompts == "".join(f"{reply}\n" for reply in expected)

    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{TURNS[0]}\n\n{TURNS[1]}\n"))  # (blank lines are skipped)
    assert main(common) == 0
    assert capsys.readouterr().out == from_prompts


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--chat-template", "none"], "--chat needs a chat template"),
        (["--prompts-file", "questions.jsonl"], "--chat reads the user's turns from --prompt (repeatable) or stdin"),
    ],
)
def test_chat_refuses_what_it_cannot_do(folder, capsys, argv: list[str], message: str) -> None:
    assert main([str(folder[0]), "--chat", "--prompt", "hi", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
