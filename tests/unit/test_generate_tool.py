"""python -m titanium.tools.generate on a small Hugging Face folder: the same completions as the engine
called directly, prompts from args and files, and bad input as one line with exit code 2."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO
from titanium.checkpoint.hf import save_hf_weights
from titanium.data.chat import Llama3Template, Message
from titanium.data.tokenizer import DEFAULT_TOKENIZER_PATH, TiktokenTokenizer
from titanium.generation.generate import generate
from titanium.generation.sampling import SamplingParams
from titanium.models.llama3 import LLAMA3_FLAVORS, Transformer
from titanium.models.llama3.hf import LLAMA3_HF_ADAPTER
from titanium.tools.generate import main

TOKENIZER = str(REPO / DEFAULT_TOKENIZER_PATH)
QUESTIONS = ["What number comes after 41?", "Sort the digits: 3 1 2", "Hi"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> tuple[Path, Transformer]:
    tokenizer = TiktokenTokenizer(TOKENIZER)
    args = dataclasses.replace(
        LLAMA3_FLAVORS["debugmodel"], n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=tokenizer.vocab_size
    )
    model = Transformer(args)
    torch.manual_seed(0)
    model.init_weights()
    out = tmp_path_factory.mktemp("hf") / "model"
    save_hf_weights(model.state_dict(), out, LLAMA3_HF_ADAPTER, args)
    return out, model.eval()


def _run(capsys, *argv: str) -> tuple[int, list[dict], str]:
    code = main([*argv, "--tokenizer", TOKENIZER, "--device", "cpu"])
    captured = capsys.readouterr()
    return code, [json.loads(line) for line in captured.out.splitlines()], captured.err


def test_completions_equal_the_engine(folder, capsys, tmp_path: Path) -> None:
    path, model = folder
    (tmp_path / "prompts.jsonl").write_text(
        json.dumps({"prompt": QUESTIONS[1]}) + "\n" + json.dumps({"messages": [{"role": "user", "content": "Hi"}]})
    )
    sampling = ["--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--max-new-tokens", "8", "--batch-size", "2"]
    files = ["--prompt", QUESTIONS[0], "--prompts-file", str(tmp_path / "prompts.jsonl")]
    code, results, err = _run(capsys, str(path), *files, *sampling)
    assert code == 0 and "tokens/s" in err
    assert [r["prompt"] for r in results] == [QUESTIONS[0], QUESTIONS[1], [{"role": "user", "content": "Hi"}]]

    tokenizer = TiktokenTokenizer(TOKENIZER)
    template = Llama3Template(tokenizer)  # auto picks the llama3 format for a Llama folder with a tiktoken file
    prompts = [template.prompt([Message("user", q)]) for q in QUESTIONS[1:]]
    generator = torch.Generator().manual_seed(3)
    params = SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9)
    expected = []
    for batch in ([template.prompt([Message("user", QUESTIONS[0])]), prompts[0]], [prompts[1]]):
        out = generate(model, batch, params, template.stop_ids, tokenizer.pad_id, generator=generator)
        expected += [tokenizer.decode(ids) for ids in out.token_lists()]
    assert [r["completion"] for r in results] == expected
    assert all(r["finish_reason"] in ("stop", "length") and 1 <= r["tokens"] <= 8 for r in results)

    # Greedy (the default) on plain text: one BOS + text prompt, deterministic.
    code, results, _ = _run(capsys, str(path), "--prompt", "abc", "--chat-template", "none", "--max-new-tokens", "5")
    plain = [tokenizer.encode("abc", bos=True, eos=False)]
    out = generate(model, plain, SamplingParams(5, 0.0), {tokenizer.eos_id}, tokenizer.pad_id)
    assert code == 0 and results[0]["completion"] == tokenizer.decode(out.token_lists()[0])


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "no prompts"),
        (["--prompt", "x", "--top-p", "0"], "--top-p in (0, 1]"),
        (["--prompt", "x", "--max-new-tokens", "5000"], "lower --max-new-tokens"),
        (["--prompts-file", "missing.txt"], "--prompts-file missing.txt: not found"),
    ],
)
def test_bad_input_exits_2_with_one_line(folder, capsys, argv: list[str], message: str) -> None:
    code, results, err = _run(capsys, str(folder[0]), *argv)
    assert code == 2 and results == [] and message in err and "Traceback" not in err


def test_bad_prompt_rows_and_folders(folder, capsys, tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    code, _, err = _run(capsys, str(folder[0]), "--prompts-file", str(tmp_path / "bad.jsonl"))
    assert code == 2 and "bad.jsonl line 2" in err
    code, _, err = _run(capsys, str(tmp_path), "--prompt", "x")
    assert code == 2 and "config.json" in err
