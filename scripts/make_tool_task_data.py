"""Make the bundled multi-turn tasks: arithmetic with a calculate tool, and a number-guessing game.

    python scripts/make_tool_task_data.py   # writes assets/tasks/calculator/*.jsonl and assets/tasks/guess_number/*

calculator: "What is 47 * 38?" / "What is 347 + 589?", which the ~6M-parameter debug model cannot work out in its
head; with the tool (``--environment.name calculator``, ``--environment.tool_parser pythonic``) an episode is

    user: What is 47 * 38?
    assistant: [calculate(expression="47 * 38")]
    user: <tool_response>\\n1786\\n</tool_response>      (the tool's result, as templates without tools render it)
    assistant: 1786

- ``sft.jsonl`` (3,000 rows): that conversation for 60% of the questions, the bare answer for the rest, so the
  fine-tuned policy calls the tool on some questions and guesses on others: the room GRPO has to improve in;
- ``train.jsonl`` (2,000 rows) and ``test.jsonl`` (300, distinct from every other row): the question and its
  answer (``{"messages": [user], "answer"}``), for GRPO's prompts and the held-out accuracy.

guess_number: ``{"messages": [user "Guess my number from 1 to 20."], "answer": "13"}`` (``train.jsonl``, 200 rows),
for ``--environment.name guess_number``. Deterministic for a given --seed.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def question(rng: random.Random) -> tuple[str, str, str]:
    """(question, expression, answer)."""
    if rng.random() < 0.5:
        a, b = rng.randint(12, 99), rng.randint(12, 99)
        expression = f"{a} * {b}"
    else:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        expression = f"{a} + {b}"
    return f"What is {expression}?", expression, str(eval(expression))  # (two numbers and an operator)


def tool_episode(q: str, expression: str, answer: str) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": q},
        {"role": "assistant", "content": f'[calculate(expression="{expression}")]'},
        {"role": "user", "content": f"<tool_response>\n{answer}\n</tool_response>"},
        {"role": "assistant", "content": answer},
    ]


def write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="assets/tasks")
    a = p.parse_args()
    rng = random.Random(a.seed)
    seen: set[str] = set()
    test = []
    while len(test) < 300:
        q, expression, answer = question(rng)
        if q not in seen:
            seen.add(q)
            test.append({"messages": [{"role": "user", "content": q}], "answer": answer})
    sft, train = [], []
    while len(sft) < 3000 or len(train) < 2000:
        q, expression, answer = question(rng)
        if q in seen:
            continue
        if len(sft) < 3000:
            messages = tool_episode(q, expression, answer) if rng.random() < 0.6 else [
                {"role": "user", "content": q}, {"role": "assistant", "content": answer}]  # fmt: skip
            sft.append({"messages": messages, "answer": answer})
        else:
            train.append({"messages": [{"role": "user", "content": q}], "answer": answer})
    out = Path(a.out)
    write(out / "calculator" / "sft.jsonl", sft)
    write(out / "calculator" / "train.jsonl", train)
    write(out / "calculator" / "test.jsonl", test)
    games = [
        {"messages": [{"role": "user", "content": "Guess my number from 1 to 20."}], "answer": str(rng.randint(1, 20))}
        for _ in range(200)
    ]
    write(out / "guess_number" / "train.jsonl", games)


if __name__ == "__main__":
    main()
