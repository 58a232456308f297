"""Make the bundled preference pairs from the bundled task data: the correct answer vs a plausible wrong one.

    python scripts/make_preference_data.py      # writes assets/tasks/arithmetic/preference_{train,test}.jsonl

Reads assets/tasks/arithmetic/{train,test}.jsonl (made by scripts/make_task_data.py) and writes one pair
per row, ``{"prompt": question, "chosen": correct answer, "rejected": wrong answer}``, the simplest
preference row shape. The wrong answers are the mistakes a small model actually makes on these tasks:

- sort ("Sort the digits: 8 3 5" -> "3 5 8"): two neighbouring digits swapped, the digits in descending
  order, the digits left as given, or one digit lost;
- max ("Which is larger: 47 or 62?" -> "62"): the smaller number;
- next ("What number comes after 389?" -> "390"): the number itself, one too many, the number before,
  or a lost carry ("380").

The held-out pairs come from the held-out questions, which never appear in the training questions (checked
here). The output is deterministic for a given --seed; both files together are about 1.2 MB.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

SORT = re.compile(r"Sort the digits: ([0-9 ]+)")
LARGER = re.compile(r"Which is larger: (\d+) or (\d+)\?")
AFTER = re.compile(r"What number comes after (\d+)\?")


def wrong_sort(digits: list[str], rng: random.Random) -> list[str]:
    ordered = sorted(digits)
    candidates = [sorted(digits, reverse=True), digits, ordered[:-1] if rng.random() < 0.5 else ordered[1:]]
    for k in range(len(ordered) - 1):
        if ordered[k] != ordered[k + 1]:
            swapped = list(ordered)
            swapped[k], swapped[k + 1] = swapped[k + 1], swapped[k]
            candidates.append(swapped)
    return [" ".join(c) for c in candidates if c != ordered]


def wrong_next(n: int) -> list[str]:
    candidates = {n, n + 2, n - 1} - {-1}
    slip = [str(n)[:-1] + str((n % 10 + 1) % 10)] if n % 10 == 9 else []  # 389 -> 380: the carry is lost
    return [str(c) for c in sorted(candidates)] + slip


def wrong_answers(question: str, rng: random.Random) -> list[str]:
    """Plausible wrong answers to one task question (never the correct one)."""
    if m := SORT.fullmatch(question):
        return wrong_sort(m.group(1).split(), rng)
    if m := LARGER.fullmatch(question):
        return [str(min(int(m.group(1)), int(m.group(2))))]
    if m := AFTER.fullmatch(question):
        return wrong_next(int(m.group(1)))
    raise ValueError(f"not a bundled task question: {question!r}")


def read_tasks(path: Path) -> list[tuple[str, str]]:
    """(question, answer) of every row of a task file."""
    pairs = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        user, assistant = row["messages"]
        pairs.append((user["content"], assistant["content"]))
    return pairs


def preference_rows(tasks: list[tuple[str, str]], rng: random.Random) -> list[dict[str, str]]:
    rows = []
    for question, answer in tasks:
        wrong = [w for w in wrong_answers(question, rng) if w != answer]
        rows.append({"prompt": question, "chosen": answer, "rejected": rng.choice(wrong)})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="assets/tasks/arithmetic", help="folder with train.jsonl and test.jsonl")
    parser.add_argument("--out", default=None, help="output folder (default: the --tasks folder)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    tasks, out = Path(args.tasks), Path(args.out or args.tasks)
    rng = random.Random(args.seed)
    train, test = read_tasks(tasks / "train.jsonl"), read_tasks(tasks / "test.jsonl")
    overlap = {q for q, _ in train} & {q for q, _ in test}
    if overlap:
        raise SystemExit(f"{len(overlap)} held-out questions also appear in train, e.g. {sorted(overlap)[0]!r}")
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "preference_train.jsonl", preference_rows(train, rng))
    write_jsonl(out / "preference_test.jsonl", preference_rows(test, rng))
    print(f"wrote {len(train)} train and {len(test)} held-out preference pairs to {out}")


if __name__ == "__main__":
    main()
