"""Tools for the multi-turn tests: well-behaved ones, and ones that raise, hang, print megabytes, return huge or
non-text results, run out of memory or take their process down (tests/unit/test_episodes.py)."""

from __future__ import annotations

import os
import sys


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def fails(x: str) -> str:
    """Raise.

    Args:
        x: Anything.
    """
    raise ValueError(f"no {x}")


def hangs() -> str:
    """Never return."""
    while True:
        pass


def chatty() -> str:
    """Print megabytes to stdout and stderr, then answer."""
    for _ in range(1000):
        print("x" * 4096)
        sys.stderr.write("y" * 4096)
    return "done"


def huge() -> str:
    """Return ten million characters."""
    return "z" * 10_000_000


def binary() -> bytes:
    """Return bytes, not text."""
    return b"\x00\x01"


def hog() -> str:
    """Allocate more memory than a tool process may have."""
    return str(len(bytearray(8 * 2**30)))


def dies() -> str:
    """Take the tool process down."""
    os._exit(3)
