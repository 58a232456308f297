"""Make the bundled fine-tuning tasks: short questions about small numbers with exactly checkable answers.

    python scripts/make_task_data.py            # writes assets/tasks/arithmetic/{train,test}.jsonl

Why these tasks: the SFT example and its exact-match evaluation must show learning on a 2-core CPU in a
few hundred steps of the ~6M-parameter debug model. The debug tokenizer splits numbers into single
digits (only "00", "10" and "19" are merged), so numbers written plainly are already digit sequences, and
every task below is solved by attending to a few digits of the prompt:

- sort:   "Sort the digits: 8 3 5"        -> "3 5 8"
- max:    "Which is larger: 47 or 62?"    -> "62"
- next:   "What number comes after 389?"  -> "390"

Measured with a minimal SFT loop (Llama 3 chat template, packing, answer tokens learned): starting from
the default job's 100-step checkpoint, 8 x 256-token batches at lr 1e-3, greedy exact match on the first
300 test rows was 38% after 100 steps and 84% after 200 (sort 99%, max 76%, next 78%).

Rows are chat conversations, ``{"messages": [user, assistant], "answer": ...}``; with the Llama 3 template
a sample is 29-36 tokens and an answer 2-7 tokens (+ end of turn). The 500 test questions are distinct,
drawn first with the tasks in turn (any first N rows are balanced), and never appear in train. Train has
15,000 rows, so both files together stay under 2 MB. The output is deterministic for a given --seed.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

Task = Callable[[random.Random], tuple[str, str]]


def sort_digits(rng: random.Random) -> tuple[str, str]:
    digits = [str(rng.randint(0, 9)) for _ in range(rng.randint(3, 4))]
    return f"Sort the digits: {' '.join(digits)}", " ".join(sorted(digits))


def larger(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(range(100), 2)
    return f"Which is larger: {a} or {b}?", str(max(a, b))


def successor(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(0, 998)
    return f"What number comes after {n}?", str(n + 1)


TASKS: dict[str, Task] = {"sort": sort_digits, "max": larger, "next": successor}


def row(question: str, answer: str) -> dict:
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages, "answer": answer}


def make_split(rng: random.Random, count: int, exclude: set[str], balanced: bool) -> list[tuple[str, str]]:
    """``count`` (question, answer) pairs whose question is not in ``exclude``; distinct when ``balanced``
    (the test set: tasks in turn, no repeats), else tasks drawn at random and repeats allowed."""
    names = list(TASKS)
    pairs, seen = [], set(exclude)
    while len(pairs) < count:
        name = names[len(pairs) % len(names)] if balanced else rng.choice(names)
        question, answer = TASKS[name](rng)
        if question in seen:
            continue
        if balanced:
            seen.add(question)
        pairs.append((question, answer))
    return pairs


def write_jsonl(path: Path, pairs: list[tuple[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for question, answer in pairs:
            f.write(json.dumps(row(question, answer), separators=(",", ":")) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="assets/tasks/arithmetic", help="folder for train.jsonl and test.jsonl")
    parser.add_argument("--train", type=int, default=15_000, help="training rows (15k: both files < 2 MB)")
    parser.add_argument("--test", type=int, default=500, help="held-out rows (distinct questions, none in train)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    test = make_split(rng, args.test, exclude=set(), balanced=True)
    train = make_split(rng, args.train, exclude={q for q, _ in test}, balanced=False)
    out = Path(args.out)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "test.jsonl", test)
    print(f"wrote {len(train)} train and {len(test)} test rows to {out}")


if __name__ == "__main__":
    main()
