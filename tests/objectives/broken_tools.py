"""A tool file that does not import (tests/unit/test_episodes.py: exit code 2 before anything starts)."""

import a_module_that_does_not_exist  # noqa: F401


def tool(x: str) -> str:
    """Never loaded.

    Args:
        x: Anything.
    """
    return x
