"""Run many command-line cases, each in a process of its own, for the price of one interpreter start.

    python -m tests.e2e.case_runner CASES.json RESULTS.json

``CASES.json`` lists ``{"module": "titanium.preflight", "argv": [...], "env": {...}}``. The runner imports
titanium's entry points (and torch) once, then forks one child per case: the child sets its environment, runs
``module.main(argv)`` with its stderr going to a file of its own and exits with what ``main`` returned (an
uncaught exception prints its traceback, as Python would, and exits 1). ``RESULTS.json`` gets each case's exit code
and stderr. So every case is a real process with a real exit code, and the suite pays the ~3 s import of torch once
per table instead of once per case.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import traceback

PRELOAD = (
    "titanium.preflight",
    "titanium.tools.convert",
    "titanium.tools.generate",
    "titanium.tools.eval_preference",
    "titanium.quantize.qat",
    "titanium.quantize.float8",
    "titanium.objectives.grpo",
    "titanium.objectives.ppo",
    "titanium.objectives.kd",
)
"""What the children would import: imported before the first fork (torchao's import alone takes seconds)."""


def run_case(case: dict, stderr_path: str) -> int:
    """In the child: the case's ``main`` with its argv and environment, stderr to ``stderr_path``."""
    fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    os.environ.update(case.get("env", {}))
    try:
        code = importlib.import_module(case["module"]).main(case["argv"])
    except SystemExit as e:  # (argparse)
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stderr.flush()
    return int(code or 0)


def main(cases_file: str, results_file: str) -> None:
    for module in PRELOAD:
        importlib.import_module(module)
    cases = json.loads(open(cases_file).read())
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for index, case in enumerate(cases):
            stderr_path = os.path.join(scratch, f"{index}.err")
            pid = os.fork()
            if pid == 0:
                os._exit(run_case(case, stderr_path))
            _, status = os.waitpid(pid, 0)
            with open(stderr_path) as f:
                results.append({"code": os.waitstatus_to_exitcode(status), "stderr": f.read()})
    with open(results_file, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
