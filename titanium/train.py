"""Entry point: `python -m titanium.train` or `torchrun --nproc_per_node N -m titanium.train`.

Bad input (a titanium.errors.UserError: config, data, tokenizer, checkpoint) ends the run with one
message and exit code 2, printed once (rank 0); a bug of ours keeps its traceback (exit code 1).
"""

from __future__ import annotations

import logging
import os
import sys

from titanium.errors import UserError, report


def _setup_logging() -> None:
    """INFO on rank 0 (TITANIUM_LOG_LEVEL=DEBUG: more, e.g. the whole resolved config), WARNING on the others."""
    rank = int(os.environ.get("RANK", 0))
    level = logging.getLevelName(os.environ.get("TITANIUM_LOG_LEVEL", "INFO").upper())
    logging.basicConfig(
        level=(level if isinstance(level, int) else logging.INFO) if rank == 0 else logging.WARNING,
        format=f"[titanium rank{rank}] %(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:  # the options need only the config classes: answer before torch loads
        from titanium.config import load_config

        load_config(argv)  # (prints them and exits)
    _setup_logging()
    from titanium.inputs import load_job  # (torch and the models: after the help)
    from titanium.parallel.distributed import shutdown_distributed, wait_for_all_ranks
    from titanium.preflight import check_job

    try:
        cfg = load_job(argv)
        dims = check_job(cfg, int(os.environ.get("WORLD_SIZE", 1)))  # before any process group exists
    except UserError as e:
        report(e)
        return 2

    from titanium.debug.flight_recorder import FlightRecorder
    from titanium.trainer import Trainer  # after the checks: the trainer's imports are heavy

    trainer = None
    try:
        with FlightRecorder(cfg.comm, cfg.job.dump_folder):  # before the process group exists
            trainer = Trainer(cfg, dims)
            trainer.train()
            wait_for_all_ranks()
    except UserError as e:  # found at run time: tokenizer, data or checkpoint files, TP vs. heads, ...
        report(e)
        return 2
    finally:
        if trainer is not None:
            trainer.close()
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
