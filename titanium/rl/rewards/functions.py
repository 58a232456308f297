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
``--rl.rewards`` names built-in functions (``exact_match``, ``format``, ``overlong``), yours as
``"package.module:function"`` (importable, e.g. on PYTHONPATH) or ``"path/to/file.py:function"``, or the folder
of a trained reward model (``titanium.rl.rewards.model_scorer``); ``register_reward`` adds a name from your own code.
A function of neither form is refused at start-up, naming it. The total reward is the weighted sum
(``--rl.reward_weights``, TRL's ``reward_weights``); each function's values are kept for metrics.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import inspect
import math
import numbers
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
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


# ---------------------------------------------------------------------------------------- resolution


def names_reward_model(spec: str) -> bool:
    """Whether a ``--rl.rewards`` entry names a reward model's folder: no ``:`` (not a function), not a
    registered name, and a directory or a path with ``/``."""
    return ":" not in spec and spec not in REWARDS.names() and ("/" in spec or Path(spec).is_dir())


_EXPORT_NAME = re.compile(r"(hf|adapter|model|export)(-step-\d+)?")
"""Folder names an export gets by default: they say nothing about which reward model it is."""


def reward_labels(names: Sequence[str]) -> dict[str, str]:
    """Each ``--rl.rewards`` entry as metrics name it (``grpo/reward/<label>``), as TRL names them after the
    function: a function's name, a reward model's folder name, with the run's folder before an export's default
    name (``rm_run/hf`` -> ``rm_run-hf``, not ``hf``). An entry whose label another entry has keeps its spelling."""
    labels = {}
    for name in names:
        if ":" in name:
            labels[name] = name.rpartition(":")[2]
        elif names_reward_model(name):
            folder = Path(name).resolve()
            generic = _EXPORT_NAME.fullmatch(folder.name) and folder.parent.name
            labels[name] = f"{folder.parent.name}-{folder.name}" if generic else folder.name
        else:
            labels[name] = name
    taken = [label for label in labels.values()]
    return {name: label if taken.count(label) == 1 else name for name, label in labels.items()}


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


TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
"""What TRL 1.16's GRPOTrainer passes every reward function, by keyword, besides the rows' columns."""
TITANIUM_KEYWORDS = ("prompt_ids",)
"""What titanium passes besides, to functions that take it (by name or ``**kwargs``)."""
_NOT_COLUMNS = ("prompt", "completion", "completion_ids")
"""Row columns TRL does not pass as columns (the prompt arrives as ``prompts``)."""


@dataclass(frozen=True)
class TrainerState:
    """What TRL passes reward functions as ``trainer_state`` (the fields of transformers' ``TrainerState`` they
    read): the optimizer steps done when the responses were sampled, of ``max_steps``."""

    global_step: int = 0
    max_steps: int = 0


def is_batched(name: str, fn: Callable[..., Any], columns: Collection[str] | None = None) -> bool:
    """Whether ``fn`` is TRL's form, called once per batch with keyword arguments (``fn(completions, **kwargs) ->
    list[float | None]``, sync or ``async``), else titanium's ``fn(completion, answer, row) -> float`` for one
    response. TRL's form is checked by TRL's rule at start-up, not after the first rollout: every parameter
    without a default must be one of the names TRL passes (``TRL_KEYWORDS``, the rows' ``columns`` when known),
    and a function without ``**kwargs`` must take all of TRL's names (TRL passes them all). ConfigError, naming
    the function and the name, otherwise."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return False  # (a builtin without a signature: called as one response's scorer)
    parameters = signature.parameters
    described = f"--rl.rewards {name!r}: {getattr(fn, '__name__', fn)}{signature}"
    if "completions" not in parameters and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        try:
            signature.bind("completion", "answer", {})
        except TypeError as e:
            raise ConfigError(
                f"{described} cannot be called as a reward function ({e}); write it as fn(completion, answer, row) "
                "-> float, or as TRL's batched fn(completions, **kwargs) -> list[float]"
            ) from None
        return False
    offered = {*TRL_KEYWORDS, *TITANIUM_KEYWORDS, *(columns or ())}
    for parameter in parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.kind is parameter.POSITIONAL_ONLY or (
            parameter.default is parameter.empty and parameter.name not in offered and columns is not None
        ):
            raise ConfigError(
                f"{described}: TRL passes reward functions only keyword arguments ({', '.join(TRL_KEYWORDS)} and "
                f"the rows' columns: {', '.join(sorted(columns or ())) or 'none'}), and none is "
                f"{parameter.name!r}; rename it or give it a default"
            )
    if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        missing = [keyword for keyword in TRL_KEYWORDS if keyword not in parameters]
        if missing:
            raise ConfigError(
                f"{described}: TRL calls it with {', '.join(TRL_KEYWORDS)} and every column of the rows, and it "
                f"takes no {', '.join(missing)}; add **kwargs to its parameters"
            )
    return True


def check_rewards(
    names: Sequence[str], configured: Collection[str] = (), reward_model_tokenizer: str = "policy"
) -> None:
    """Resolve every reward name as the objective will, without building a model (titanium.preflight, before any
    process starts): functions import and have a reward function's signature, reward model folders hold a
    config.json of a titanium family (``reward_model_tokenizer`` own: and a tokenizer.json). ``configured``: names
    the objective builds from its own settings (GRPO's ``overlong``)."""
    for name in names:
        if name in configured:
            continue
        if names_reward_model(name):
            from titanium.rl.rewards.model_scorer import reward_model_config  # (imports the model builder)

            reward_model_config(name, "own" if reward_model_tokenizer == "own" else "policy")
        else:
            is_batched(name, resolve_reward(name))


@dataclass(frozen=True)
class Rewards:
    total: torch.Tensor
    """``[N]`` float32: the weighted sum of the functions' values that apply (TRL's NaN-skipping sum); NaN where
    none applies (every function returned None), which the advantages then leave at 0."""
    per_function: dict[str, torch.Tensor]
    """Each function's own ``[N]`` values (unweighted), by its name in ``--rl.rewards``; NaN where it returned
    None (does not apply)."""
    extra: dict[str, list[Any]] = field(default_factory=dict)
    """Columns the functions logged with TRL's ``log_extra`` (one value per response): shown in the completions
    table."""
    logged: dict[str, list[float]] = field(default_factory=dict)
    """Numbers the functions logged with TRL's ``log_metric``, by name."""


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
        columns: Collection[str] | None = None,
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
        self.internal = set(configured)  # (titanium's own, built from the config: they read responses as text)
        columns = None if columns is None else [c for c in columns if c not in _NOT_COLUMNS]
        self.batched = {name for name, fn in self.functions.items() if is_batched(name, fn, columns)}
        self.weights = dict(zip(names, weights or [1.0] * len(names)))
        self.tokens: dict[str, list[Any]] = {}
        self.state = TrainerState()

    @classmethod
    def from_config(
        cls,
        cfg: RLSection,
        *,
        device: torch.device | None = None,
        pad_id: int = 0,
        vocab_size: int | None = None,
        columns: Collection[str] | None = None,
    ) -> RewardSet:
        """The rewards of ``[rl]``; reward models named there are loaded onto ``device`` (scoring sequences
        padded with ``pad_id``, the job's tokenizer's, whose ``vocab_size`` ids they must cover), or, with
        ``reward_model_layout = "sharded"``, left to the caller (``elsewhere``). ``columns``: the prompt rows'
        columns, when known, for TRL's signature check."""
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
        return cls(cfg.rewards, cfg.reward_weights, configured, elsewhere=sharded, columns=columns)

    def with_tokens(
        self,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        prompts: Sequence[str | list[dict[str, Any]]] | None = None,
        state: TrainerState | None = None,
    ) -> RewardSet:
        """This set, scoring responses whose token ids (stop token included) and prompts' ids are given: batched
        functions get them as ``completion_ids`` (as in TRL) and ``prompt_ids``, and, when given, each response's
        prompt as TRL passes it (``prompts``: the text, or the conversation as role/content dicts; a response to a
        conversation is then passed as TRL passes it, ``[{"role": "assistant", "content": text}]``) and the
        training's progress as ``trainer_state``."""
        bound = copy.copy(self)
        bound.tokens = {
            "prompt_ids": [list(p) for p in prompt_ids],
            "completion_ids": [list(c) for c in completion_ids],
            **({"prompts": list(prompts)} if prompts is not None else {}),
        }
        bound.state = state or self.state
        return bound

    def __call__(
        self, completions: Sequence[str], answers: Sequence[str | None], rows: Sequence[Mapping[str, Any]]
    ) -> Rewards:
        extra: dict[str, list[Any]] = {}
        logged: dict[str, list[float]] = {}
        kwargs = self._trl_kwargs(completions, rows, extra, logged)
        values: dict[str, Any] = {}
        pending = {}  # TRL's async functions: run together, as TRL gathers them
        for name, fn in self.functions.items():
            if name not in self.batched:
                values[name] = [self._score(name, fn, *args) for args in zip(completions, answers, rows)]
                continue
            result = self._batch(
                name, fn, {**kwargs, "completions": list(completions)} if name in self.internal else kwargs
            )
            if inspect.isawaitable(result):
                pending[name] = result
            else:
                values[name] = self._checked(name, result, len(completions))
        if pending:
            results = asyncio.run(_gather(list(pending.values())))
            for (name, _), result in zip(pending.items(), results):
                values[name] = self._checked(name, result, len(completions))
        per_function = {name: torch.tensor(values[name], dtype=torch.float32) for name in self.functions}
        return Rewards(self._total(per_function, len(completions)), per_function, extra, logged)

    def _total(self, per_function: Mapping[str, torch.Tensor], n: int) -> torch.Tensor:
        """The weighted sum of the values that apply; NaN where none does (TRL's ``nansum``, then NaN for rows no
        function scored)."""
        total, scored = torch.zeros(n), torch.zeros(n, dtype=torch.bool)
        for name, values in per_function.items():
            applies = ~values.isnan()
            total += torch.where(applies, self.weights[name] * values, 0.0)
            scored |= applies
        return torch.where(scored, total, torch.nan) if per_function else total

    def _trl_kwargs(
        self,
        completions: Sequence[str],
        rows: Sequence[Mapping[str, Any]],
        extra: dict[str, list[Any]],
        logged: dict[str, list[float]],
    ) -> dict[str, Any]:
        """What TRL's GRPOTrainer passes its reward functions: the responses (as messages after a conversation), the
        prompts, the ids, each column of the rows as a list (not ``prompt``), ``trainer_state``, ``log_extra`` and
        ``log_metric``."""
        columns = {key: [row.get(key) for row in rows] for key in dict.fromkeys(k for row in rows for k in row)}
        for key in (*_NOT_COLUMNS, "completions"):
            columns.pop(key, None)
        prompts = self.tokens.get("prompts")
        if prompts is not None:
            shown = [
                [{"role": "assistant", "content": c}] if isinstance(p, list) else c
                for p, c in zip(prompts, completions)
            ]
        else:
            shown = list(completions)

        def log_extra(column: str, values: Sequence[Any]) -> None:
            extra.setdefault(column, []).extend(values)

        def log_metric(name: str, value: float) -> None:
            logged.setdefault(name, []).append(float(value))

        return {
            **columns,
            **self.tokens,
            "completions": shown,
            "trainer_state": self.state,
            "log_extra": log_extra,
            "log_metric": log_metric,
        }

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

    @staticmethod
    def _batch(name: str, fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> Any:
        """TRL's call, with the keywords ``fn`` takes (all of them with ``**kwargs``); an ``async`` function's
        coroutine is returned to be awaited with the others."""
        parameters = inspect.signature(fn).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            kwargs = {key: value for key, value in kwargs.items() if key in parameters}
        try:
            return fn(**kwargs)
        except UserError:
            raise
        except Exception as e:  # the user's function: say which one, keep its traceback
            raise RuntimeError(
                f"reward function {name!r} failed on a batch of {len(kwargs['completions'])}: {e}"
            ) from e

    @staticmethod
    def _checked(name: str, values: Any, n: int) -> list[float]:
        if not isinstance(values, Sequence) or len(values) != n:
            raise UserError(
                f"reward function {name!r} returned {type(values).__name__} for {n} completions; a "
                "batched reward function returns a list of one number (or None) per completion"
            )
        return [_finite(name, value) for value in values]


async def _gather(coroutines: list[Any]) -> list[Any]:
    return list(await asyncio.gather(*coroutines))


def _finite(name: str, value: Any) -> float:
    """A reward value as a float; None (the function does not apply to this response, as TRL allows) is NaN."""
    if value is None:
        return math.nan
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise UserError(
            f"reward function {name!r} returned {value!r}; it must return a finite number, or None where it does "
            "not apply"
        )
    return float(value)
