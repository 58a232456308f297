"""python -m titanium.tools.generate --prompts-file on TRL's rows: a "prompt" column holding a string or a
conversation (prompt-only, prompt/completion and preference rows, with tools) is rendered to the same ids as
transformers' ``apply_chat_template(prompt, add_generation_prompt=True)`` (TRL's rendering of a prompt) on a
tokenizer trained here with Qwen 2.5's tool-capable template, with and without a BOS; a string prompt under
``--chat-template none`` to the ids of ``tokenizer(prompt)``, as TRL reads strings. Bad rows: exit code 2, one
line naming the file's line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.unit.test_trl_formats import TOOL_CHAT, TOOLS, make_tokenizer
from titanium.checkpoint.hf import save_hf_weights
from titanium.generation.generate import generate
from titanium.models.llama3 import LLAMA3_FLAVORS, Transformer
from titanium.models.llama3.hf import LLAMA3_HF_ADAPTER
from titanium.tools import generate as generate_tool
from titanium.tools.generate import main

USER = {"role": "user", "content": "what is two plus three"}
ROWS = [
    {"prompt": "what is the answer"},
    {"prompt": [{"role": "user", "content": "hello world"}]},
    {  # prompt/completion: the completion is not read
        "prompt": [{"role": "system", "content": "Be brief."}, USER],
        "completion": [{"role": "assistant", "content": "5"}],
    },
    {  # preference, several turns
        "prompt": [USER, {"role": "assistant", "content": "5"}, {"role": "user", "content": "plus two"}],
        "chosen": [{"role": "assistant", "content": "7"}],
        "rejected": [{"role": "assistant", "content": "6"}],
    },
    {"prompt": TOOL_CHAT[:4], "tools": TOOLS},  # ends with the tools' results: the answer comes next
]


@pytest.fixture(scope="module", params=["no BOS", "BOS"])
def folder(request, tmp_path_factory):
    """A random tiny Llama in a folder holding the tokenizer (and its chat template); transformers' tokenizer."""
    out = tmp_path_factory.mktemp("trl_prompts") / "model"
    tokenizer, _ = make_tokenizer(tmp_path_factory.mktemp("tokenizer"), bos=request.param == "BOS")
    args = dataclasses.replace(
        LLAMA3_FLAVORS["debugmodel"], n_layers=1, dim=32, n_heads=2, n_kv_heads=1, vocab_size=tokenizer.vocab_size
    )
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    save_hf_weights(model.state_dict(), out, LLAMA3_HF_ADAPTER, args)
    _, hf_tokenizer = make_tokenizer(out, bos=request.param == "BOS")  # (the weights' folder is written first)
    return out, hf_tokenizer


def _rendered(folder: Path, tmp_path: Path, monkeypatch, rows: list, *argv: str) -> tuple[int, list[list[int]]]:
    """Exit code of tools.generate on ``rows`` and the prompt ids it generated from."""
    seen: list[list[int]] = []

    def recording(model, batch, *args, **kwargs):
        seen.extend(list(row) for row in batch)
        return generate(model, batch, *args, **kwargs)

    monkeypatch.setattr(generate_tool, "generate", recording)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    code = main([str(folder), "--prompts-file", str(tmp_path / "prompts.jsonl"), "--max-new-tokens", "2", *argv])
    return code, seen


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def test_prompt_ids_equal_transformers_apply_chat_template(folder, tmp_path, monkeypatch, capsys) -> None:
    path, hf_tokenizer = folder
    code, seen = _rendered(path, tmp_path, monkeypatch, ROWS, "--device", "cpu")
    assert code == 0
    expected = []
    for row in ROWS:
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        rendered = hf_tokenizer.apply_chat_template(
            messages, tools=row.get("tools"), add_generation_prompt=True, tokenize=True
        )
        expected.append(_ids(rendered))
    assert seen == expected
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in results] == [row["prompt"] for row in ROWS]

    # Without a template a string is plain text, as TRL tokenizes string prompts: tokenizer(prompt).
    code, seen = _rendered(path, tmp_path, monkeypatch, ROWS[:1], "--chat-template", "none")
    assert code == 0 and seen == [_ids(hf_tokenizer(ROWS[0]["prompt"]))]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": [USER, {"role": "assistant", "content": "5"}]}, "ends with a message of role 'assistant'"),
        ({"prompt": []}, "'prompt' is an empty list of messages"),
        ({"prompt": [USER, {"role": "system", "content": "x"}]}, "a system message is only allowed as the first"),
        ({"prompt": [{"content": "no role"}]}, "message 0 has no 'role'"),
        ({"prompt": 42}, "not a list of messages"),
    ],
)
def test_bad_prompt_rows_exit_2(folder, tmp_path, monkeypatch, capsys, row: dict, message: str) -> None:
    code, _ = _rendered(folder[0], tmp_path, monkeypatch, [ROWS[1], row])
    err = capsys.readouterr().err
    assert code == 2 and "prompts.jsonl line 2: " in err and message in err and "Traceback" not in err


def test_tools_under_a_template_that_cannot_render_them_exit_2(folder, tmp_path, monkeypatch, capsys) -> None:
    code, _ = _rendered(folder[0], tmp_path, monkeypatch, ROWS, "--chat-template", "chatml")
    err = capsys.readouterr().err
    assert code == 2 and "prompt 5 (" in err and "only a tokenizer's own chat template" in err
