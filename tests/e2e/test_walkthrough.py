"""docs/post_training.md's walk-through (own Hugging Face model -> SFT -> DPO -> GRPO with an own reward -> export ->
``transformers`` generate), run exactly as written.

Every code block after a ``<!-- walkthrough: run -->`` comment runs in bash, in order, in a scratch folder that
links the repository's ``assets/`` (the doc's blocks run from the repository root, which is also put on
``PYTHONPATH`` for ``titanium``); a block after ``<!-- walkthrough: file NAME -->`` is saved there as NAME. Each
must exit 0. Then, beyond "it runs": SFT's loss fell to under half of its first step's; the GRPO run logged the
own reward function's values; the exported model's logits in ``transformers`` equal titanium's on the same tokens
(1e-5, fp32); and ``transformers``' greedy answers, printed by the last block, equal ``tools.generate``'s.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, env
from titanium.model_builder import ModelBuilder
from titanium.models import get_model_spec

transformers = pytest.importorskip("transformers")

DOC = REPO / "docs/post_training.md"
BLOCK = re.compile(r"<!-- walkthrough: (run|file (\S+)) -->\n```\w+\n(.*?)```", re.S)
STEP_LOSS = re.compile(r"step\s+(\d+)/\d+\s+loss\s+(-?[\d.]+)")


def walkthrough_blocks() -> list[tuple[str | None, str]]:
    """(file name, or None for a command; code) of each marked block of the doc, in order."""
    return [(m.group(2), m.group(3)) for m in BLOCK.finditer(DOC.read_text())]


def run_block(code: str, folder: Path) -> str:
    """Run one shell block as a user would (bash, stop at the first failing command); its stdout + stderr."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # (`python` is this one)
    result = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", code],
        cwd=folder,
        env={**env(), "PATH": path, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"block failed ({result.returncode}):\n{code}\n{result.stderr[-4000:]}"
    return result.stdout + result.stderr


def test_walkthrough_runs_as_written(tmp_path: Path) -> None:
    blocks = walkthrough_blocks()
    names = [name for name, _ in blocks]  # (a block that lost its mark would go unrun: the list says which to expect)
    assert names == ["make_my_model.py", None, None, None, "my_reward.py", None, None, "chat.py", None]
    (tmp_path / "assets").symlink_to(REPO / "assets")
    logs: dict[str, str] = {}
    for name, code in blocks:
        if name is not None:
            (tmp_path / name).write_text(code)
        else:
            logs[code] = run_block(code, tmp_path)

    def log_of(text: str) -> str:
        return next(log for code, log in logs.items() if text in code)

    losses = [float(loss) for _, loss in STEP_LOSS.findall(log_of("--training.objective sft"))]
    assert len(losses) >= 2 and losses[-1] < 0.5 * losses[0], losses
    grpo = log_of("--training.objective grpo")
    assert len(re.findall(r" answer_reward [\d.]+ ", grpo)) == 5, grpo[-2000:]  # (one per step, TRL's name)
    for run in ("sft", "dpo", "grpo"):  # (nothing but the objective said what the folder and the data are)
        said = log_of(f"--training.objective {run}")
        assert "its tokenizer and chat template" in said and "--data.kind auto: " in said, said[-2000:]

    # The LoRA adapter loads with peft onto the SFT export and computes the merged export (both carry the tokenizer).
    peft = pytest.importorskip("peft")
    dpo = tmp_path / "outputs/walkthrough/dpo"
    probe = torch.tensor([[5, 17, 300, 42, 7, 99]])
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "outputs/walkthrough/sft/hf").float().eval()
    adapted = peft.PeftModel.from_pretrained(base, dpo / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(dpo / "hf").float().eval()
    with torch.no_grad():
        assert (adapted(input_ids=probe).logits - merged(input_ids=probe).logits).abs().max() <= 1e-5
    for export in (dpo / "adapter", dpo / "hf"):
        assert len(transformers.AutoTokenizer.from_pretrained(export)) == merged.config.vocab_size

    folder = tmp_path / "outputs/walkthrough/grpo/hf"
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
    ours = ModelBuilder(torch.device("cpu")).load_hf(get_model_spec("qwen3"), folder).model.float().eval()
    tokens = torch.tensor([tokenizer("What number comes after 41? 42, then 43.")["input_ids"]])
    with torch.no_grad():
        assert (ours(tokens) - hf_model(input_ids=tokens).logits).abs().max() <= 1e-5

    titanium_answers = [
        json.loads(line)["completion"] for line in log_of("titanium.tools.generate").splitlines() if line[:1] == "{"
    ]
    printed = [line.split(" -> ", 1) for line in log_of("python chat.py").splitlines() if " -> " in line]
    assert [question for question, _ in printed] == ["What number comes after 41?", "Which is larger: 12 or 71?"]
    assert [answer for _, answer in printed] == titanium_answers and any(a.strip() for a in titanium_answers)
