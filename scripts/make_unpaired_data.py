"""Make the bundled unpaired (KTO) data from the bundled preference pairs: each pair gives two rows.

    python scripts/make_unpaired_data.py    # writes assets/tasks/arithmetic/unpaired_{train,test}.jsonl

Reads assets/tasks/arithmetic/preference_{train,test}.jsonl (made by scripts/make_preference_data.py) and writes,
for each pair, ``{"prompt": p, "completion": chosen, "label": true}`` and ``{"prompt": p, "completion":
rejected, "label": false}``: TRL's unpaired format, as its ``unpair_preference_dataset`` makes it. The rows are
shuffled (--seed), so the two rows of a pair are rarely neighbours: KTO's mismatched pairs (each prompt with the
previous row's completion) then seldom share their prompt. The training file takes the first --pairs pairs
(10,000 rows, about 0.7 MB, by default); the held-out file takes every held-out pair.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def unpaired_rows(pairs: list[dict], rng: random.Random) -> list[dict]:
    rows = [
        {"prompt": pair["prompt"], "completion": pair[side], "label": side == "chosen"}
        for pair in pairs
        for side in ("chosen", "rejected")
    ]
    rng.shuffle(rows)
    return rows


def convert(source: Path, target: Path, limit: int | None, rng: random.Random) -> int:
    pairs = [json.loads(line) for line in source.read_text().splitlines()[:limit]]
    rows = unpaired_rows(pairs, rng)
    target.write_text("".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows))
    return len(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="assets/tasks/arithmetic", help="folder with preference_*.jsonl")
    parser.add_argument("--pairs", type=int, default=5000, help="training pairs to convert")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    tasks, rng = Path(args.tasks), random.Random(args.seed)
    train = convert(tasks / "preference_train.jsonl", tasks / "unpaired_train.jsonl", args.pairs, rng)
    test = convert(tasks / "preference_test.jsonl", tasks / "unpaired_test.jsonl", None, rng)
    print(f"wrote {train} train and {test} held-out unpaired rows to {tasks}")


if __name__ == "__main__":
    main()
