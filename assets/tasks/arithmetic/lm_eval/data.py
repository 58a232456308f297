"""Offline loaders of the arithmetic lm-eval tasks (the YAMLs' ``custom_dataset``): local jsonl files found from this
file, so the tasks work from any working directory and never reach for the Hugging Face Hub."""

from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def load_mc(**metadata):
    """arithmetic_mc.jsonl (scripts/make_lm_eval_tasks.py): question, choices, label."""
    return datasets.load_dataset("json", data_files={"test": str(HERE / "arithmetic_mc.jsonl")})


def load_gen(**metadata):
    """The held-out chat rows of ../test.jsonl as question and answer."""
    rows = datasets.load_dataset("json", data_files={"test": str(HERE.parent / "test.jsonl")})
    return rows.map(lambda row: {"question": row["messages"][0]["content"]}, remove_columns=["messages"])
