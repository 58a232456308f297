"""What a job's inputs say that its flags leave out, as TRL users expect, said at start-up.

Started from a Hugging Face folder (``--checkpoint.initial_load_path X --checkpoint.initial_load_in_hf``), the
model family is its config.json's and the tokenizer (with its chat template) is the folder's own; a flag that says
otherwise is an error naming both, so a run never trains one tokenizer's ids into a model made for another's.
With ``--data.kind auto`` (the default), the kind of data is what the dataset's columns hold; a GRPO/PPO prompt
file without the answer column gets no reference answers rather than an error. Every titanium entry point loads
its config through ``load_job``; the checks on the tokenizer's size against the embedding come later, where the
model is resolved (``titanium.checkpoint.hf.hf_model_args``).
"""

from __future__ import annotations

import json
import logging
import os
from glob import glob
from pathlib import Path
from typing import Any

from titanium.config import ConfigError, load_config
from titanium.config.components import OBJECTIVES
from titanium.config.sections import TokenizerSection
from titanium.config.validate import looks_local
from titanium.data.tokenizer import has_tokenizer

logger = logging.getLogger("titanium")

_PROBE = "Hello world! 19 foxes, 2024 dogs: naïve café 中文 🚀\n\n  x"
"""Text two tokenizers must encode alike to count as the same."""


def load_job(argv: list[str]) -> Any:
    """The job config of ``argv`` (titanium.train's arguments), completed from its inputs and validated."""
    return load_config(argv, resolve=resolve_inputs)


def resolve_inputs(cfg: Any, given: frozenset[str]) -> None:
    """Fill in from the Hugging Face start folder and the data what the config (``given``: the keys it set) leaves
    out; log each choice."""
    from titanium.data.kinds import detect_kind, has_column, string_rule  # (reads data: torch-backed readers)

    ck = cfg.checkpoint
    if ck.initial_load_in_hf and ck.initial_load_path and (Path(ck.initial_load_path) / "config.json").is_file():
        _from_hf_folder(cfg, Path(ck.initial_load_path), given)
    objective = cfg.training.objective
    if cfg.data.kind == "synthetic" or (looks_local(cfg.data.path) and not glob(os.path.expanduser(cfg.data.path))):
        return  # (no rows to look at; the config check names missing data)
    if cfg.data.kind == "auto":
        cfg.data.kind, why = detect_kind(cfg.data, objective)
        if objective != "pretrain":  # (pretraining reads text whatever the columns)
            logger.info("--data.kind auto: %s (%s)", cfg.data.kind, why)
        section = cfg.rl if _reads_rollouts(objective) else None
        if section is not None and section.answer_column and "rl.answer_column" not in given:
            if not has_column(cfg.data, section.answer_column):
                logger.info(
                    "no '%s' column: prompts have no reference answers (--rl.answer_column)", section.answer_column
                )
                section.answer_column = ""
    rule = string_rule(cfg.data, objective, cfg.chat.chat_template)
    if rule is not None:
        logger.info("strings in %s: %s", cfg.data.path, rule)


def _reads_rollouts(objective: str) -> bool:
    """Whether a registered objective draws prompts from the rollout source (its registry entry reads [rl])."""
    return objective in OBJECTIVES and any(spec.name == "rl" for spec in OBJECTIVES.more_sections(objective))


def _from_hf_folder(cfg: Any, folder: Path, given: frozenset[str]) -> None:
    """The family from config.json's model_type, and the folder's own tokenizer."""
    from titanium.models import hf_family  # (the model registry imports torch)

    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return  # (the checkpoint loader names what is wrong with the file)
    family = hf_family(model_type)
    if family is not None and cfg.model.name != family and cfg.model.backend != "transformers":
        if "model.name" in given:
            raise ConfigError(
                f"--model.name {cfg.model.name} disagrees with {folder / 'config.json'} (model_type {model_type!r}: "
                f"titanium's {family}); leave --model.name out (the folder says it) or start from a "
                f"{cfg.model.name} folder"
            )
        cfg.model.name = family
    if not has_tokenizer(folder):
        return  # (the configured tokenizer must then fit the embedding: hf_model_args)
    if given & {"tokenizer.kind", "tokenizer.path"}:
        _check_same_tokenizer(cfg.tokenizer, folder)
        return
    cfg.tokenizer.kind, cfg.tokenizer.path = "hf", str(folder)
    model = f"model {family} (model_type {model_type!r}), " if family is not None else ""
    logger.info("from %s: %sits tokenizer and chat template", folder, model)


def _check_same_tokenizer(section: TokenizerSection, folder: Path) -> None:
    """A tokenizer set by flags must be the start folder's own: the same ids."""
    from titanium.data.tokenizer import HFTokenizer, build_tokenizer

    if section.kind == "hf" and folder.resolve() in (Path(section.path).resolve(), Path(section.path).resolve().parent):
        return
    flag = f"--tokenizer.kind {section.kind}" + (f" --tokenizer.path {section.path}" if section.kind != "byte" else "")
    theirs, own = build_tokenizer(section), HFTokenizer(str(folder))
    same = theirs.vocab_size == own.vocab_size and theirs.encode(_PROBE, bos=False, eos=False) == own.encode(
        _PROBE, bos=False, eos=False
    )
    if not same:
        raise ConfigError(
            f"{flag} ({theirs.vocab_size} ids) is not the tokenizer of {folder} ({own.vocab_size} ids, and other "
            "ids for the same text): the model was trained on its folder's ids; leave the --tokenizer flags out to "
            "use the folder's, or start from a folder made with that tokenizer"
        )
    logger.info("tokenizer %s: the same ids as %s's own", flag, folder)
