"""The compatibility matrix as data (``matrix.json``, committed beside this file) and as the table in
``docs/models.md`` (between two markers), which is rendered from it: one row per causal-LM ``model_type``, one
column per cell (``cells.CELLS``), and the reason for the first cell that is not ``yes``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.backend_matrix.cells import CELLS, NO, REFUSED, STATUS_RANK, UNTESTED, YES, Cell

HERE = Path(__file__).resolve().parent
MATRIX = HERE / "matrix.json"
DOC = HERE.parents[1] / "docs" / "models.md"
START, END = "<!-- backend-matrix:start -->", "<!-- backend-matrix:end -->"
SYMBOL = {YES: "yes", NO: "**no**", REFUSED: "refused", UNTESTED: "·"}
HEADERS = {
    "load": "loads",
    "step": "step",
    "logits": "logits",
    "grads": "grads",
    "fsdp": "FSDP 2",
    "tp": "TP 2",
    "pp": "PP 2",
    "packing": "packing",
    "lora": "LoRA→peft",
    "hf": "HF round trip",
}
FAMILIES = {
    "Llama": "llama",
    "Qwen2 / Qwen2.5": "qwen2",
    "Qwen3": "qwen3",
    "Qwen3.5": "qwen3_5_text",
    "Qwen3-MoE": "qwen3_moe",
    "Qwen3-Next": "qwen3_next",
    "Gemma": "gemma",
    "Gemma 2": "gemma2",
    "Gemma 3": "gemma3_text",
    "Gemma 4": "gemma4_text",
    "Mistral": "mistral",
    "Ministral 3": "ministral3",
    "Mixtral": "mixtral",
    "Phi-3 / Phi-4": "phi3",
    "GPT-OSS": "gpt_oss",
    "DeepSeek-V2": "deepseek_v2",
    "DeepSeek-V3": "deepseek_v3",
    "SmolLM3": "smollm3",
    "OLMo 2": "olmo2",
    "OLMo 3": "olmo3",
    "OLMoE": "olmoe",
    "GLM-4": "glm4",
    "GLM-4.5 (MoE)": "glm4_moe",
    "Granite": "granite",
    "Granite MoE": "granitemoe",
    "Command R (Cohere)": "cohere",
    "Command R7B (Cohere 2)": "cohere2",
    "ERNIE 4.5": "ernie4_5",
    "StarCoder2": "starcoder2",
    "EXAONE 4": "exaone4",
}
"""The most-downloaded families (name -> model_type): their cells may never get worse than the committed matrix's
(``tests/unit/test_backend_matrix.py``)."""


def load_matrix(path: Path = MATRIX) -> dict[str, Any]:
    return json.loads(path.read_text())


def rows(matrix: dict[str, Any]) -> dict[str, dict[str, Cell]]:
    return {mt: {name: Cell(*cell) for name, cell in row.items()} for mt, row in matrix["rows"].items()}


def worse_cells(committed: dict[str, Cell], now: dict[str, Cell]) -> list[str]:
    """The cells of one architecture that are worse now than committed (``STATUS_RANK``), each with both details."""
    return [
        f"{name}: {committed[name].status} ({committed[name].detail}) -> {now[name].status} ({now[name].detail})"
        for name in committed
        if name in now and STATUS_RANK[now[name].status] < STATUS_RANK[committed[name].status]
    ]


def _reason(row: dict[str, Cell]) -> str:
    first = next((row[name] for name in CELLS if row[name].status != YES), None)
    if first is None:
        return ""
    name = next(name for name in CELLS if row[name] is first)
    text = first.detail.replace("|", "/").replace("\n", " ")
    for noise in ("transformers from ", "--model.hf_config "):
        text = text.replace(noise, "")
    return f"{HEADERS[name]}: {text[:140]}{'…' if len(text) > 140 else ''}"


def render(matrix: dict[str, Any]) -> str:
    """The markdown table of ``matrix`` (with the versions it was measured with and the counts)."""
    table = rows(matrix)
    families = {mt: name for name, mt in FAMILIES.items()}
    passing = [
        mt
        for mt, row in table.items()
        if all(row[c].status == YES for c in ("load", "step", "logits", "grads", "fsdp", "lora"))
    ]
    loads = [mt for mt, row in table.items() if row["load"].status == YES]
    lines = [
        START,
        f"Measured with transformers {matrix['transformers']}, torch {matrix['torch']}, on CPU (gloo for the layouts), "
        f"by `{matrix['command']}`: {len(table)} causal-LM model types; {len(loads)} load, {len(passing)} pass "
        "load, step, logits, gradients, FSDP 2 and LoRA. `refused`: titanium refuses it before any process group "
        "with the message in the last column (or the first one); `·`: not run (an earlier cell failed or "
        "`transformers` cannot build the tiny config).",
        "",
        "| model_type | family | " + " | ".join(HEADERS[c] for c in CELLS) + " | first reason |",
        "|---|---|" + "---|" * len(CELLS) + "---|",
    ]
    for mt in sorted(table, key=lambda m: (m not in families, m)):
        row = table[mt]
        cells = " | ".join(SYMBOL[row[c].status] for c in CELLS)
        lines.append(f"| `{mt}` | {families.get(mt, '')} | {cells} | {_reason(row)} |")
    lines.append(END)
    return "\n".join(lines)


def write_doc(matrix: dict[str, Any], doc: Path = DOC) -> None:
    text = doc.read_text()
    before, rest = text.split(START, 1)
    _, after = rest.split(END, 1)
    doc.write_text(before + render(matrix) + after)


def doc_table(doc: Path = DOC) -> str:
    text = doc.read_text()
    return START + text.split(START, 1)[1].split(END, 1)[0] + END
