"""Config keys that moved to another section: still read where users wrote them, with a deprecation warning.

``[sft] chat_template`` and ``[sft] system_prompt`` became ``[chat]`` keys when every objective (SFT, DPO, GRPO)
and the evaluation came to read them. GRPO's and PPO's sampling, prompt, reward and logging keys became ``[rl]``
keys when both came to draw from one rollout source (``titanium.rl.source``); PPO's ``reward_model_path`` became
the first entry of ``[rl] rewards`` (a reward model is named there by its folder), its ``rewards`` the entries after
it. TRL's flat DPO knobs (``[dpo] label_smoothing``, ``simpo_gamma``, ``cpo_alpha``) became the parameters of the
losses that read them (``[dpo.<loss_type>]``, titanium/config/dpo_losses.py). A key given both ways is an error
(which one would win is not obvious).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from titanium.config.dpo_losses import FLAT_KNOBS, LOSS_KNOBS
from titanium.config.errors import ConfigError

logger = logging.getLogger("titanium")

_RL_KEYS = {
    "grpo": (
        "temperature",
        "top_p",
        "top_k",
        "max_new_tokens",
        "max_prompt_len",
        "answer_column",
        "rewards",
        "reward_weights",
        "overlong_buffer",
        "reward_model_layout",
        "reward_model_dtype",
        "reward_model_tokenizer",
        "max_policy_lag",
        "dynamic_sampling",
        "dynamic_sampling_max_rounds",
        "pad_to",
        "pad_multiple",
        "log_completions",
        "log_completions_count",
    ),
    "ppo": (
        "temperature",
        "top_p",
        "top_k",
        "max_new_tokens",
        "max_prompt_len",
        "answer_column",
        "rewards",
        "reward_weights",
        "log_completions",
        "log_completions_count",
    ),
}

MOVED = {
    ("sft", "chat_template"): ("chat", "chat_template"),
    ("sft", "system_prompt"): ("chat", "system_prompt"),
    **{(section, key): ("rl", key) for section, keys in _RL_KEYS.items() for key in keys},
}
"""(old section, key) -> (new section, key)."""

PPO_REWARD_MODEL = ("ppo", "reward_model_path")
"""PPO's reward model folder: now the first of ``[rl] rewards``, with weight 1 before the rule rewards' weights, held
sharded under the training plan as PPO held it (``[rl] reward_model_layout`` sharded, unless given)."""


def _warn(old: str, new: str) -> None:
    logger.warning("%s is deprecated and will be removed: use %s (the same setting, moved)", old, new)


def move_toml_keys(data: dict[str, Any], where: str) -> dict[str, Any]:
    """``data`` (a parsed TOML file) with moved keys in their new sections."""
    data = {name: dict(values) if isinstance(values, dict) else values for name, values in data.items()}
    _move_ppo_reward_model(data, where)
    for (old_section, key), (new_section, new_key) in MOVED.items():
        values = data.get(old_section)
        if not isinstance(values, dict) or key not in values:
            continue
        target = data.setdefault(new_section, {})
        if isinstance(target, dict) and new_key in target:
            raise ConfigError(
                f"{where}: [{old_section}] {key} and [{new_section}] {new_key} are the same setting; "
                f"keep only [{new_section}] {new_key}"
            )
        _warn(f"{where}: [{old_section}] {key}", f"[{new_section}] {new_key}")
        if isinstance(target, dict):
            target[new_key] = values.pop(key)
        if not values:
            del data[old_section]
    return data


def _move_ppo_reward_model(data: dict[str, Any], where: str) -> None:
    """``[ppo] reward_model_path`` (with ``[ppo] rewards`` / ``reward_weights``, the rule rewards added to it) as
    ``[rl] rewards`` = [the folder, the rule rewards...] and the weights [1, the rule weights...]."""
    section, key = PPO_REWARD_MODEL
    ppo = data.get(section)
    if not isinstance(ppo, dict) or key not in ppo:
        return
    folder = ppo.pop(key)
    rl = data.setdefault("rl", {})
    if not isinstance(rl, dict) or "rewards" in rl:
        raise ConfigError(
            f"{where}: [ppo] reward_model_path and [rl] rewards both name rewards; keep only [rl] rewards"
        )
    _warn(f"{where}: [ppo] reward_model_path", "[rl] rewards (the folder as its first entry)")
    if folder:
        rl["rewards"] = [folder, *ppo.pop("rewards", [])]
        rl.setdefault("reward_model_layout", "sharded")
        if "reward_weights" in ppo:
            rl["reward_weights"] = [1.0, *ppo.pop("reward_weights")]
    if not ppo:
        del data[section]


def move_flags(argv: list[str]) -> list[str]:
    """``argv`` with moved ``--section.key`` flags renamed (``--section.key=value`` too)."""
    renames = {}
    for (old_section, key), (new_section, new_key) in MOVED.items():
        for spelling in (key, key.replace("_", "-")):
            renames[f"--{old_section}.{spelling}"] = f"--{new_section}.{new_key}"
    given = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    out = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        new = renames.get(flag)
        if new is None:
            out.append(arg)
            continue
        if new in given or new.replace("_", "-") in given:
            raise ConfigError(f"{flag} and {new} are the same setting; keep only {new}")
        _warn(flag, new)
        out.append(new + eq + value)
    return out


def take_ppo_reward_model(argv: list[str]) -> tuple[list[str], str | None]:
    """``argv`` without ``--ppo.reward_model_path X``, and X (None when not given): ``prepend_reward_model`` puts it
    in front of ``[rl] rewards`` once the config is parsed."""
    spellings = ("--ppo.reward_model_path", "--ppo.reward-model-path")
    found = [i for i, arg in enumerate(argv) if arg.split("=", 1)[0] in spellings]
    if not found:
        return argv, None
    i = found[-1]
    flag, eq, value = argv[i].partition("=")
    if not eq and i + 1 >= len(argv):
        raise ConfigError(f"{flag} needs a value")
    _warn(flag, "--rl.rewards (the folder as its first entry)")
    return (argv[:i] + argv[i + 1 :], value) if eq else (argv[:i] + argv[i + 2 :], argv[i + 1])


def prepend_reward_model(rl: Any, folder: str, rules_given: bool, layout_given: bool) -> None:
    """PPO's ``--ppo.reward_model_path folder`` in the parsed ``[rl]`` section: the folder first, then the rule
    rewards if any were given (PPO's rule rewards defaulted to none), the weights with 1 for the folder; held sharded
    unless the layout was given."""
    rl.rewards = [folder, *(rl.rewards if rules_given else [])]
    if rl.reward_weights:
        rl.reward_weights = [1.0, *rl.reward_weights]
    if not layout_given:
        rl.reward_model_layout = "sharded"


def move_dpo_knobs(
    data: dict[str, Any], argv: list[str], where: str | None, loss_flag: str | None
) -> tuple[dict[str, Any], list[str]]:
    """``data`` (a parsed TOML file) and ``argv`` with TRL's flat DPO knobs in the parameters of the loss that reads
    them: label_smoothing in the job's loss's (``loss_flag``, else the file's ``[dpo] loss_type``, else sigmoid),
    simpo_gamma and cpo_alpha in simpo's (checked there against the job's loss). label_smoothing for a loss without
    it is dropped at its default 0 (old configs wrote it), else refused, naming the loss."""
    dpo = data.get("dpo") if isinstance(data.get("dpo"), dict) else {}
    loss = loss_flag or dpo.get("loss_type") or "sigmoid"
    for flat in [name for name in FLAT_KNOBS if name in dpo]:
        old = f"{where}: [dpo] {flat}"
        owner = _knob_owner(flat, loss, dpo[flat], old)
        value = dpo.pop(flat)
        if owner is not None:
            table = dpo.setdefault(owner, {})
            if FLAT_KNOBS[flat] in table:
                raise ConfigError(f"{old} and [dpo.{owner}] {FLAT_KNOBS[flat]} are the same setting; keep the second")
            _warn(old, f"[dpo.{owner}] {FLAT_KNOBS[flat]}")
            table[FLAT_KNOBS[flat]] = value
    out, i = [], 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        flat = flag.removeprefix("--dpo.").replace("-", "_") if flag.startswith("--dpo.") else ""
        if flat not in FLAT_KNOBS:
            out.append(argv[i])
            i += 1
            continue
        if not eq and i + 1 >= len(argv):
            raise ConfigError(f"{flag} needs a value")
        value = value if eq else argv[i + 1]
        owner = _knob_owner(flat, loss, value, flag)
        if owner is not None:
            new = f"--dpo.{owner}.{FLAT_KNOBS[flat]}"
            if any(arg.split("=", 1)[0] in (new, new.replace("_", "-")) for arg in argv):
                raise ConfigError(f"{flag} and {new} are the same setting; keep only {new}")
            _warn(flag, new)
            out += [new, value]
        i += 1 if eq else 2
    return data, out


def _knob_owner(flat: str, loss: str, value: Any, name: str) -> str | None:
    """The loss whose parameters take the flat knob ``flat`` set to ``value`` (None: dropped, being its default)."""
    key = FLAT_KNOBS[flat]
    owners = [owner for owner, cls in LOSS_KNOBS.items() if key in {f.name for f in dataclasses.fields(cls)}]
    if loss in owners or len(owners) == 1:
        return loss if loss in owners else owners[0]
    default = getattr(LOSS_KNOBS[owners[0]](), key)
    try:
        at_default = float(value) == default
    except (TypeError, ValueError):
        at_default = False
    if not at_default:
        raise ConfigError(
            f"{name} {value!r}: --dpo.loss_type {loss} reads no {flat}; the losses that do ({', '.join(owners)}) take "
            f"it as [dpo.<loss_type>] {key} (--dpo.<loss_type>.{key})"
        )
    logger.warning("%s is deprecated and will be removed: --dpo.loss_type %s reads none (dropped)", name, loss)
    return None
