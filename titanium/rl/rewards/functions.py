"""Reward functions for RL on verifiable tasks: plain Python callables, registered by name or imported by path.

A reward function scores one response:

    def my_reward(completion: str, answer: str | None, row: Mapping[str, Any]) -> float: ...

``completion`` is the decoded response (without its end-of-turn token), ``answer`` the prompt row's
reference answer (``--rl.answer_column``; None when there is none) and ``row`` the whole prompt row,
for any other column. TRL's batched form is taken too:

    def my_reward(completions: list[str], **columns) -> list[float]: ...

called once per batch with the responses and, by column name, each column of their prompt rows as a list
(TRL's ``**kwargs``), plus, where the caller bound them (``RewardSet.with_tokens``: GRPO does), TRL's
``completion_ids`` (each response's token ids, its stop token included) and ``prompt_ids``.
``--rl.rewards`` names built-in functions (``exact_match``, ``format``, ``overlong``, ``math_verify``), yours as
``"package.module:function"`` (importable, e.g. on PYTHONPATH) or ``"path/to/file.py:function"``, or the folder
of a trained reward model (``titanium.rl.rewards.model_scorer``); ``register_reward`` adds a name from your own code.
A function of neither form is refused at start-up, naming it. The total reward is the weighted sum
(``--rl.reward_weights``, TRL's ``reward_weights``); each function's values are kept for metrics.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import math
import numbers
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titanium.config.loader import ConfigError
from titanium.config.registry import Registry
from titanium.config.sections import RLSection
from titanium.errors import UserError

RewardFn = Callable[[str, str | None, Mapping[str, Any]], float]

REWARDS = Registry("reward function", "--rl.rewards")


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make ``fn`` available as ``--rl.rewards name``; a taken name is an error."""

    def add(fn: RewardFn) -> RewardFn:
        REWARDS.register(name, fn)
        return fn

    return add


# ------------------------------------------------------------------------------------------ built in


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, braces balanced; None if there is none (or it is unclosed)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None


_ANSWER_IS = re.compile(r"(?:answer is|answer:)\s*", re.IGNORECASE)


def extract_answer(text: str) -> str:
    """The final answer of a response, for math-style tasks.

    After any ``<think>...</think>`` block: the content of the last ``\\boxed{...}``; else what follows the
    last ``####`` (GSM8K style); else what follows the last "answer is" / "answer:"; else the whole text.
    """
    text = text.rsplit("</think>", 1)[-1]
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[-1]
    found = list(_ANSWER_IS.finditer(text))
    return text[found[-1].end() :] if found else text


_NUMBER = re.compile(r"[-+]?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?")


def normalize_answer(text: str) -> str:
    """Compare answers on content, not typesetting: outer whitespace, ``$``, a final period and repeated
    spaces go; a single number loses thousands separators and trailing zeros (``1,000.50`` -> ``1000.5``)."""
    text = " ".join(text.strip().strip("$").strip().rstrip(".").split())
    if _NUMBER.fullmatch(text):
        number = text.replace(",", "").lstrip("+")
        if "." in number:
            number = number.rstrip("0").rstrip(".")
        return "0" if number in ("-0", "") else number
    return text


@register_reward("exact_match")
def exact_match(completion: str, answer: str | None, row: Mapping[str, Any]) -> float:
    """1.0 when the response's final answer equals the reference's (both extracted, so a GSM8K-style
    reference "... #### 72" works, and normalized), else 0.0."""
    if answer is None:
        raise UserError(
            "the exact_match reward needs reference answers: point --rl.answer_column at the rows' answer column"
        )
    return float(normalize_answer(extract_answer(completion)) == normalize_answer(extract_answer(answer)))


_THINK_FORMAT = re.compile(r"\s*<think>(?:(?!<think>).)+?</think>\s*\S.*", re.DOTALL)


@register_reward("format")
def think_format(completion: str, answer: str | None, row: Mapping[str, Any]) -> float:
    """1.0 for reasoning in one leading ``<think>...</think>`` block followed by an answer, else 0.0."""
    return 1.0 if _THINK_FORMAT.fullmatch(completion) else 0.0


class SoftOverlongPunishment:
    """DAPO's soft overlong punishment (its Eq. 13; TRL's ``get_soft_overlong_punishment``), a batched reward of
    the response lengths L in tokens (stop token included): 0 up to ``max_len - buffer``, then
    ``(max_len - buffer - L) / buffer`` down to -1 at ``max_len``, and -1 beyond. It discourages running into the
    length limit without rewarding brevity below it. ``--rl.rewards overlong`` with ``max_len`` the
    ``max_new_tokens`` and ``buffer`` the ``overlong_buffer``."""

    __name__ = "overlong"

    def __init__(self, max_len: int, buffer: int) -> None:
        self.max_len, self.buffer = max_len, buffer

    def __call__(self, completions: list[str], completion_ids: Sequence[Sequence[int]], **kwargs: Any) -> list[float]:
        return [self.penalty(len(ids)) for ids in completion_ids]

    def penalty(self, length: int) -> float:
        start = self.max_len - self.buffer
        if length <= start:
            return 0.0
        return (start - length) / self.buffer if length <= self.max_len else -1.0


REWARDS.register("math_verify", "titanium.rl.rewards.math_verify:math_verify")  # (pip install math-verify)


# ---------------------------------------------------------------------------------------- resolution


def names_reward_model(spec: str) -> bool:
    """Whether a ``--rl.rewards`` entry names a reward model's folder: no ``:`` (not a function), not a
    registered name, and a directory or a path with ``/``."""
    return ":" not in spec and spec not in REWARDS.names() and ("/" in spec or Path(spec).is_dir())


def resolve_reward(spec: str) -> RewardFn:
    """A registered name, ``"package.module:function"`` imported, or ``"path/to/file.py:function"``; errors name
    ``--rl.rewards``."""
    path, _, attribute = spec.rpartition(":")
    fn = _from_file(spec, Path(path), attribute) if path.endswith(".py") else REWARDS.load(spec)
    if not callable(fn):
        raise ConfigError(f"--rl.rewards {spec!r} is not a function")
    return fn


def _from_file(spec: str, path: Path, attribute: str) -> Any:
    """``attribute`` of the Python file ``path``, run as a module of its own."""
    if not path.is_file():
        raise ConfigError(f"--rl.rewards {spec!r}: no file {path}")
    module_spec = importlib.util.spec_from_file_location(f"titanium_rewards_{path.stem}", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)  # (an error inside the user's file keeps its traceback)
    if not hasattr(module, attribute):
        raise ConfigError(f"--rl.rewards {spec!r}: {path} has no {attribute!r}")
    return getattr(module, attribute)


def is_batched(name: str, fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is TRL's batched form ``fn(completions, **columns) -> list[float]`` (else it scores one
    response, ``fn(completion, answer, row) -> float``). ConfigError, naming it, for a function of neither form:
    at start-up, not after the first rollout."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False  # (a builtin without a signature: called as one response's scorer)
    if "completions" in parameters and any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return True
    try:
        inspect.signature(fn).bind("completion", "answer", {})
    except TypeError as e:
        raise ConfigError(
            f"--rl.rewards {name!r}: {getattr(fn, '__name__', fn)}{inspect.signature(fn)} cannot be called as a "
            f"reward function ({e}); write it as fn(completion, answer, row) -> float, or as TRL's batched "
            "fn(completions, **kwargs) -> list[float]"
        ) from None
    return False


@dataclass(frozen=True)
class Rewards:
    total: torch.Tensor
    """``[N]`` float32: the weighted sum of the functions' values."""
    per_function: dict[str, torch.Tensor]
    """Each function's own ``[N]`` values (unweighted), by its name in ``--rl.rewards``."""


class RewardSet:
    """The configured reward functions and weights; ``reward_set(completions, answers, rows)`` -> ``Rewards``.

    ``configured`` holds functions built from the config rather than resolved by name (``overlong``, reward
    models); ``with_tokens`` binds a batch's token ids for the batched functions that read them. ``elsewhere``
    names rewards scored by the caller (sharded reward models): left out of ``__call__``'s total, added by
    ``complete``."""

    def __init__(
        self,
        names: Sequence[str],
        weights: Sequence[float] = (),
        configured: Mapping[str, Callable] | None = None,
        elsewhere: Collection[str] = (),
    ) -> None:
        if weights and len(weights) != len(names):
            raise ValueError(f"{len(weights)} weights for {len(names)} reward functions")
        configured = configured or {}
        self.names, self.elsewhere = list(names), [name for name in names if name in elsewhere]
        self.functions = {
            name: configured[name] if name in configured else resolve_reward(name)
            for name in names
            if name not in elsewhere
        }
        self.batched = {name for name, fn in self.functions.items() if is_batched(name, fn)}
        self.weights = dict(zip(names, weights or [1.0] * len(names)))
        self.tokens: dict[str, list[Any]] = {}

    @classmethod
    def from_config(
        cls, cfg: RLSection, *, device: torch.device | None = None, pad_id: int = 0, vocab_size: int | None = None
    ) -> RewardSet:
        """The rewards of ``[rl]``; reward models named there are loaded onto ``device`` (scoring sequences
        padded with ``pad_id``, the job's tokenizer's, whose ``vocab_size`` ids they must cover), or, with
        ``reward_model_layout = "sharded"``, left to the caller (``elsewhere``)."""
        configured: dict[str, Callable] = {}
        sharded = [n for n in cfg.rewards if names_reward_model(n)] if cfg.reward_model_layout == "sharded" else []
        for name in cfg.rewards:
            if name in sharded:
                continue
            if name == "overlong":
                configured[name] = SoftOverlongPunishment(cfg.max_new_tokens, cfg.overlong_buffer)
            elif names_reward_model(name):
                from titanium.rl.rewards.model_scorer import RewardModelScorer  # (builds models: only when asked)

                configured[name] = RewardModelScorer.load(
                    name,
                    device=device or torch.device("cpu"),
                    pad_id=pad_id,
                    vocab_size=vocab_size,
                    max_seq_len=cfg.max_prompt_len + cfg.max_new_tokens,
                    dtype=cfg.reward_model_dtype,
                    tokenizer=cfg.reward_model_tokenizer,
                )
        return cls(cfg.rewards, cfg.reward_weights, configured, elsewhere=sharded)

    def with_tokens(
        self,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        prompts: Sequence[str | list[dict[str, Any]]] | None = None,
        **columns: Sequence[Any],
    ) -> RewardSet:
        """This set, scoring responses whose token ids (stop token included) and prompts' ids are given: batched
        functions get them as ``completion_ids`` (as in TRL) and ``prompt_ids``, and, when given, each response's
        prompt as TRL passes it (``prompts``: the text, or the conversation as role/content dicts) and further
        per-response ``columns`` by name (multi-turn episodes: ``completion_messages``)."""
        bound = copy.copy(self)
        bound.tokens = {
            "prompt_ids": [list(p) for p in prompt_ids],
            "completion_ids": [list(c) for c in completion_ids],
            **({"prompts": list(prompts)} if prompts is not None else {}),
            **{name: list(values) for name, values in columns.items()},
        }
        return bound

    def __call__(
        self, completions: Sequence[str], answers: Sequence[str | None], rows: Sequence[Mapping[str, Any]]
    ) -> Rewards:
        per_function = {
            name: torch.tensor(
                self._batch(name, fn, completions, rows)
                if name in self.batched
                else [self._score(name, fn, *args) for args in zip(completions, answers, rows)]
            )
            for name, fn in self.functions.items()
        }
        total = torch.zeros(len(completions))
        for name, values in per_function.items():
            total += self.weights[name] * values
        return Rewards(total, per_function)

    def complete(self, rewards: Rewards, scores: Mapping[str, torch.Tensor]) -> Rewards:
        """``rewards`` (of ``__call__``) with the ``elsewhere`` rewards' ``scores`` added to the total by their
        weights and to the per-function values, in the configured order."""
        assert sorted(scores) == sorted(self.elsewhere), (sorted(scores), self.elsewhere)
        total = rewards.total.clone()
        for name, values in scores.items():
            total += self.weights[name] * values.to(total.device, total.dtype)
        mine = {**rewards.per_function, **{k: v.to(total.device, total.dtype) for k, v in scores.items()}}
        return Rewards(total, {name: mine[name] for name in self.names})

    @staticmethod
    def _score(name: str, fn: RewardFn, completion: str, answer: str | None, row: Mapping[str, Any]) -> float:
        try:
            value = fn(completion, answer, row)
        except UserError:
            raise
        except Exception as e:  # the user's function: say which one and on what, keep its traceback
            raise RuntimeError(f"reward function {name!r} failed on the response {completion[:80]!r}: {e}") from e
        return _finite(name, value)

    def _batch(
        self, name: str, fn: Callable[..., Any], completions: Sequence[str], rows: Sequence[Mapping[str, Any]]
    ) -> list[float]:
        """TRL's batched call: the responses, each column of their rows as a list, by name, and the bound ids."""
        columns = {key: [row.get(key) for row in rows] for key in dict.fromkeys(k for row in rows for k in row)}
        columns.pop("completions", None)
        columns.update(self.tokens)
        try:
            values = fn(completions=list(completions), **columns)
        except UserError:
            raise
        except Exception as e:  # the user's function: say which one, keep its traceback
            raise RuntimeError(f"reward function {name!r} failed on a batch of {len(completions)}: {e}") from e
        if not isinstance(values, Sequence) or len(values) != len(completions):
            raise UserError(
                f"reward function {name!r} returned {type(values).__name__} for {len(completions)} completions; a "
                "batched reward function returns a list of one number per completion"
            )
        return [_finite(name, value) for value in values]


def _finite(name: str, value: Any) -> float:
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise UserError(f"reward function {name!r} returned {value!r}; it must return a finite number")
    return float(value)
