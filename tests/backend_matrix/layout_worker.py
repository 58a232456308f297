"""Runs the matrix's training jobs one after the other in one launch, recording each job's outcome instead of stopping
at the first failure: ``python -m tests.backend_matrix.layout_worker JOBS.json RESULTS.json`` (one process) or under
torchrun (every rank runs every job; rank 0 writes the results).

JOBS.json maps a job name to its ``titanium.train`` arguments. RESULTS.json maps it to ``["ok", ""]``,
``["refused", message]`` (a ``UserError``: what the user would see, exit code 2) or ``["error", what]`` (any
other exception). The jobs share the launch's process group as in ``tests/distributed/jobs_worker.py``; after an
error the launch stops (one rank may have failed inside a collective its peer still waits in, and every later job
would fail on the broken group), and ``layouts.launch`` runs the jobs not answered in a new one.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import titanium.train
import titanium.trainer
from tests.backend_matrix.cells import describe
from tests.distributed.jobs_worker import join_or_init
from titanium.parallel import distributed


def run(jobs_path: str, results_path: str) -> None:
    titanium.trainer.init_distributed = join_or_init
    shutdown = distributed.shutdown_distributed
    distributed.shutdown_distributed = lambda: None  # titanium.train imports it when main() runs
    reported: list[str] = []
    titanium.train.report = lambda error: reported.append(str(error))
    results: dict[str, list[str]] = {}
    try:
        for name, argv in json.loads(Path(jobs_path).read_text()).items():
            reported.clear()
            try:
                code = titanium.train.main(argv)
                results[name] = ["ok", ""] if code == 0 else ["refused", " ".join(reported) or f"exit code {code}"]
            except Exception as e:  # noqa: BLE001 (one job's failure is its cell's result)
                results[name] = ["error", describe(e)]
            if int(os.environ.get("RANK", 0)) == 0:
                Path(results_path).write_text(json.dumps(results, indent=1))
            if results[name][0] == "error":
                break  # (a job that failed on one rank leaves the group unusable: the launcher starts the rest anew)
    finally:
        shutdown()


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2])
