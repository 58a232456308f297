"""The one base class for mistakes in what the user gave us (config, data, checkpoint, tokenizer).

The entry point reports these as a single message without a traceback and exits with code 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
import time

OTHER_RANKS_WAIT_S = 10.0
"""How long ranks other than 0 wait before printing a user error (see ``report``): long enough for torchrun
to stop them after rank 0 has printed, even on a loaded machine (measured: 3 s was not, with load 8 on 2 cores)."""


class UserError(Exception):
    """Bad input from the user; the message names the file/key/row and the fix."""

    label = "error"
    """How the report introduces the message: ``titanium: <label>: <message>``."""


def report(error: UserError) -> None:
    """Print ``error`` as one line on stderr, once per job.

    Every rank of a job usually meets the same bad input, and rank 0 prints it at once. The other ranks
    wait a moment first: under torchrun, rank 0's exit stops them before they print, and their own exit
    cannot stop rank 0 before it has printed (unless it meets the problem more than the wait later); a rank
    that meets a problem of its own still reports it.
    """
    if int(os.environ.get("RANK", "0")) != 0:
        time.sleep(OTHER_RANKS_WAIT_S)
    print(f"titanium: {error.label}: {error}", file=sys.stderr)
