"""python -m titanium.tools.inspect_data: the first samples as the run's objective makes them (its chat template,
packing and loss mask), token by token; what it shows is what transformers' apply_chat_template gives."""

from __future__ import annotations

import json
import re

import pytest

from tests.tokenizer_families import family_tokenizer
from titanium.tools.inspect_data import inspect, main

transformers = pytest.importorskip("transformers")

CHATS = [
    {
        "messages": [
            {"role": "user", "content": f"What is {i} + {i}?"},
            {"role": "assistant", "content": f"It is {2 * i}."},
        ]
    }
    for i in range(6)
]


def _blocks(shown: str) -> list[str]:
    """The output's blocks: samples and padding notes (a sample's own text may hold blank lines)."""
    return re.split(r"\n\n(?=sample \d+ \(|\(row )", shown)


def _run_args(tmp_path, *extra: str) -> list[str]:
    folder = family_tokenizer("qwen2", tmp_path / "qwen")  # (a Hugging Face start folder: its tokenizer and template)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in CHATS))
    return [
        "--training.objective", "sft", "--data.path", str(data), "--job.dump_folder", str(tmp_path / "out"),
        "--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf",
        "--training.seq_len", "128", "--training.local_batch_size", "1", *extra,
    ]  # fmt: skip


def test_samples_as_the_run_packs_and_masks_them(tmp_path):
    shown = inspect(_run_args(tmp_path), samples=3, color=False)
    blocks = _blocks(shown)
    heads = [b.split(" (")[0] for b in blocks]
    assert heads == ["sample 0", "sample 1", "(row 0 ends with 37 padding tokens)", "sample 2"]  # (two packed a row)
    assert "(row 0," in blocks[1] and "(row 1," in blocks[3]
    first = blocks[0].splitlines()
    # The chat template's rendering, and exactly the answer with its end of turn learned.
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "qwen")
    ids = auto.apply_chat_template(CHATS[0]["messages"], tokenize=True, return_dict=False)
    assert first[-2] == "  ids:  " + " ".join(map(str, ids))
    assert "\n".join(first[1:-2]).endswith("<|im_start|>assistant\n[[It is 0.<|im_end|>\n]]")
    answer = auto.encode("It is 0.<|im_end|>\n", add_special_tokens=False)
    assert first[-1] == "  loss: " + "0" * (len(ids) - len(answer)) + "1" * len(answer)


def test_colours_in_a_terminal_and_prompts_for_rl(tmp_path, capsys):
    assert main(["--samples", "1", "--color", "always", *_run_args(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b[42;30m" in out and "\x1b[100;37m" in out and "[[" not in out  # learned green, prompt grey
    grpo = _run_args(tmp_path, "--training.objective", "grpo", "--training.local_batch_size", "8")
    shown = inspect([*grpo, "--training.seq_len", "1024"], samples=1, color=False)
    assert shown.startswith("sample 0") and "0 learned" in shown and shown.count("<|im_start|>assistant") == 1


def test_preference_pairs_share_their_prompt(tmp_path):
    """DPO rows: the prompt once, then each response as a sample of its own, wholly learned (its end of turn too)."""
    from tests.helpers import REPO

    args = [
        "--training.objective", "dpo", "--data.path", str(REPO / "assets/tasks/arithmetic/preference_train.jsonl"),
        "--chat.chat_template", "llama3", "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--job.dump_folder", str(tmp_path),
    ]  # fmt: skip
    prompt, chosen, rejected = _blocks(inspect(args, samples=3, color=False))[:3]
    assert "What number comes after 771?" in prompt and "0 learned" in prompt
    assert chosen.splitlines()[1] == "[[772<|eot_id|>]]" and rejected.splitlines()[1] == "[[771<|eot_id|>]]"
