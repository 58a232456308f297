"""Config keys that moved to another section: still read where users wrote them, with a deprecation warning.

``[sft] chat_template`` and ``[sft] system_prompt`` became ``[chat]`` keys when every objective (SFT, DPO, GRPO)
and the evaluation came to read them. A key given both ways is an error (which one would win is not obvious).
"""

from __future__ import annotations

import logging
from typing import Any

from titanium.config.errors import ConfigError

logger = logging.getLogger("titanium")

MOVED = {
    ("sft", "chat_template"): ("chat", "chat_template"),
    ("sft", "system_prompt"): ("chat", "system_prompt"),
}
"""(old section, key) -> (new section, key)."""


def _warn(old: str, new: str) -> None:
    logger.warning(
        "%s is deprecated and will be removed: use %s (the same setting, now read by every objective "
        "and by evaluation)",
        old,
        new,
    )


def move_toml_keys(data: dict[str, Any], where: str) -> dict[str, Any]:
    """``data`` (a parsed TOML file) with moved keys in their new sections."""
    data = {name: dict(values) if isinstance(values, dict) else values for name, values in data.items()}
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
