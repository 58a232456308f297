"""The config's own error type (kept apart so every config module can raise it)."""

from __future__ import annotations

from titanium.errors import UserError


class ConfigError(UserError, ValueError):
    """A user mistake in the job config; reported as one line, exit code 2, no traceback."""

    label = "config error"
