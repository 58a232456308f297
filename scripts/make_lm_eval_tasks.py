"""Make the lm-eval multiple-choice task data from the bundled task data: each held-out question with its answer
among plausible wrong ones.

    python scripts/make_lm_eval_tasks.py     # writes assets/tasks/arithmetic/lm_eval/arithmetic_mc.jsonl

Reads assets/tasks/arithmetic/test.jsonl (made by scripts/make_task_data.py) and writes one row per question,
``{"question": ..., "choices": [...], "label": index of the answer}``, the answer among up to three of the wrong
answers scripts/make_preference_data.py draws from (a swapped digit, the smaller number, a lost carry, ...), in a
seeded order. The generation task (arithmetic_gen.yaml) reads test.jsonl itself. Both task YAMLs sit beside the data
with data.py, which loads it offline: ``--include_path assets/tasks/arithmetic/lm_eval``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from make_preference_data import read_tasks, wrong_answers


def choice_rows(tasks: list[tuple[str, str]], rng: random.Random) -> list[dict]:
    rows = []
    for question, answer in tasks:
        wrong = sorted({w for w in wrong_answers(question, rng) if w != answer})
        choices = [answer, *rng.sample(wrong, min(3, len(wrong)))]
        rng.shuffle(choices)
        rows.append({"question": question, "choices": choices, "label": choices.index(answer)})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="assets/tasks/arithmetic", help="folder with test.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.tasks) / "lm_eval" / "arithmetic_mc.jsonl"
    rows = choice_rows(read_tasks(Path(args.tasks) / "test.jsonl"), random.Random(args.seed))
    with out.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
    print(f"wrote {len(rows)} multiple-choice questions to {out}")


if __name__ == "__main__":
    main()
