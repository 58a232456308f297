"""Show the first samples of a run as its objective will see them: tokens, text, loss mask, packing boundaries.

    python -m titanium.tools.inspect_data [--samples N] [--color auto|always|never] <titanium.train arguments>

    # e.g. how an SFT run renders its chats (its chat template, what is learned)
    python -m titanium.tools.inspect_data --job.config_file train_configs/debug_sft.toml

The arguments are the run's own (a config file and flags, a Hugging Face start folder...), resolved as
``titanium.train`` resolves them, and the batches come from the run's own objective, so what is shown is what
trains: rows as packed, each sample's text token by token with the tokens that carry loss in green (as TRL's
dataset views colour them; prompt tokens grey, alternating shades mark token boundaries), and a ``|`` where a
packed row moves to its next sample. Without colour (a pipe, a file, ``--color never``), learned text is shown
between ``[[`` and ``]]``. GRPO and PPO show their prompts (what is learned is sampled later). No model is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from collections.abc import Iterator
from typing import Any

import torch

from titanium.config.components import OBJECTIVES
from titanium.errors import UserError, report
from titanium.inputs import load_job

IGNORE_INDEX = -100
_LEARNED = ("\x1b[42;30m", "\x1b[102;30m")  # (green, alternating shades: token boundaries)
_PROMPT = ("\x1b[100;37m", "\x1b[47;30m")
_RESET = "\x1b[0m"


@dataclasses.dataclass(frozen=True)
class Sample:
    """One sample of a row: its tokens and which carry loss (as targets)."""

    row: int
    tokens: list[int]
    learned: list[bool]


def samples_of(batch: Any, first_row: int = 0) -> Iterator[Sample]:
    """The samples of a microbatch (its rows numbered from ``first_row``): each row cut where its document ids
    change; token t is learned when the label at t - 1 (the prediction of token t) is not ignored, or, in rows whose
    responses share a prompt (DPO's ``label_sources``), the label at t itself."""
    labels = getattr(batch.fields, "labels", None)
    own_column = getattr(batch.fields, "label_sources", None) is not None
    for row in range(batch.tokens.shape[0]):
        tokens = batch.tokens[row].tolist()
        learned = [False] * len(tokens)
        if labels is not None:
            targets = [target != IGNORE_INDEX for target in labels[row].tolist()]
            learned = targets if own_column else [False, *targets[:-1]]
        documents = batch.document_ids[row].tolist() if batch.document_ids is not None else [0] * len(tokens)
        start = 0
        for end in range(1, len(tokens) + 1):
            if end == len(tokens) or documents[end] != documents[start]:
                yield Sample(first_row + row, tokens[start:end], learned[start:end])
                start = end


def render(sample: Sample, tokenizer: Any, color: bool) -> str:
    """The sample's text token by token: learned tokens marked (colour, or [[...]] without it)."""
    pieces, inside = [], False
    for k, (token, learned) in enumerate(zip(sample.tokens, sample.learned)):
        text = tokenizer.decode([token])
        if color:
            pieces.append((_LEARNED if learned else _PROMPT)[k % 2] + text + _RESET)
            continue
        if learned != inside:
            pieces.append("[[" if learned else "]]")
            inside = learned
        pieces.append(text)
    if inside:
        pieces.append("]]")
    return "".join(pieces)


def is_padding(sample: Sample, tokenizer: Any) -> bool:
    """A row's tail of pad tokens (not a sample: it carries no loss)."""
    return not any(sample.learned) and all(token == tokenizer.pad_id for token in sample.tokens)


def describe(sample: Sample, index: int, tokenizer: Any, color: bool) -> str:
    learned = sum(sample.learned)
    head = f"sample {index} (row {sample.row}, {len(sample.tokens)} tokens, {learned} learned)"
    mask = "".join("1" if flag else "0" for flag in sample.learned)
    return "\n".join(
        [head, render(sample, tokenizer, color), f"  ids:  {' '.join(map(str, sample.tokens))}", f"  loss: {mask}"]
    )


class _NoModel:
    """Stands in for a model an objective asks for at construction (a DPO reference, a KD teacher): inspecting data
    never runs one."""

    def __init__(self, what: str) -> None:
        self._what = what

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"inspect_data builds no models; the objective used its {self._what} ({name})")


class _NoModels:
    def frozen(self, **kwargs: Any) -> Any:
        return _NoModel("frozen model")

    def policy(self) -> Any:
        return _NoModel("policy")

    def trainable(self, source: Any) -> Any:
        return _NoModel("trained model")


def _objective(cfg: Any, tokenizer: Any) -> Any:
    """The run's objective, built without models (the data side only), on the CPU, one data-parallel rank."""
    from titanium.model_setup import job_model_spec
    from titanium.objectives import ObjectiveContext, build_objective

    t = cfg.training
    ctx = ObjectiveContext(
        tokenizer=tokenizer,
        model_name=(spec := job_model_spec(cfg)).name,
        chat_format=spec.chat_template or "",
        vocab_size=tokenizer.vocab_size,
        seq_len=t.seq_len,
        local_batch_size=t.local_batch_size,
        dp_rank=0,
        dp_world=1,
        seed=cfg.debug.seed,
        loss_chunk_size=t.loss_chunk_size,
        models=_NoModels(),
        device=torch.device("cpu"),
        chat=cfg.chat,
        dump_folder=cfg.job.dump_folder,
        total_steps=t.steps,
    )
    return build_objective(t.objective, ctx, dataclasses.replace(cfg.data, prefetch_batches=0), cfg)


def _prompts(cfg: Any, tokenizer: Any) -> Iterator[Sample]:
    """The RL objectives' prompts, as their rollout source makes them (what is learned is sampled later)."""
    from titanium.data.chat import build_chat_template
    from titanium.data.prompts import PromptDataset
    from titanium.model_setup import job_model_spec

    fmt = job_model_spec(cfg).chat_template or ""
    template = build_chat_template(cfg.chat.chat_template, tokenizer, fmt) if cfg.data.kind != "text" else None
    for sample in PromptDataset(cfg.data, cfg.rl, tokenizer, template, cfg.chat.system_prompt):
        yield Sample(0, sample.prompt, [False] * len(sample.prompt))


def inspect(argv: list[str], samples: int, color: bool) -> str:
    """The first ``samples`` samples of the run ``argv`` describes, as text."""
    from titanium.data.tokenizer import build_tokenizer

    cfg = load_job(argv)
    tokenizer = build_tokenizer(cfg.tokenizer)
    rollouts = any(spec.name == "rl" for spec in OBJECTIVES.more_sections(cfg.training.objective))
    if rollouts:
        stream: Iterator[Sample] = _prompts(cfg, tokenizer)
    else:
        objective, rows = _objective(cfg, tokenizer), cfg.training.local_batch_size
        stream = (sample for n in itertools.count() for sample in samples_of(objective.next_microbatch(), n * rows))
    shown: list[str] = []
    index = 0
    for sample in stream:
        if index == samples:
            break
        if is_padding(sample, tokenizer):
            shown.append(f"(row {sample.row} ends with {len(sample.tokens)} padding tokens)")
            continue
        shown.append(describe(sample, index, tokenizer, color))
        index += 1
    return "\n\n".join(shown)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m titanium.tools.inspect_data",
        description=__doc__.split("\n\n")[0],
        epilog="Every other argument is titanium.train's (python -m titanium.train --help).",
    )
    parser.add_argument("--samples", type=int, default=4, help="how many samples to show (default 4)")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto", help="(default auto)")
    args, rest = parser.parse_known_args(argv)
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    try:
        print(inspect(rest, args.samples, color))
    except UserError as e:
        report(e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
