"""Entry point: `python -m titanium.train` or `torchrun --nproc_per_node N -m titanium.train`."""

from __future__ import annotations

import logging
import os
import sys

from titanium.config import ConfigError, load_config
from titanium.errors import UserError
from titanium.parallel.dims import ParallelDims
from titanium.parallel.distributed import shutdown_distributed, wait_for_all_ranks
from titanium.peft.lora import check_lora_config


def _setup_logging() -> None:
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[titanium rank{rank}] %(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _setup_logging()
    try:
        cfg = load_config(argv)
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        dims = ParallelDims.from_config(cfg.parallelism, world_size)
        check_lora_config(cfg.lora)
    except ConfigError as e:
        print(f"titanium: config error: {e}", file=sys.stderr)
        return 2

    from titanium.debug.flight_recorder import FlightRecorder
    from titanium.trainer import Trainer  # after config checks: torch-heavy imports only for real runs

    trainer = None
    try:
        with FlightRecorder(cfg.comm, cfg.job.dump_folder):  # before the process group exists
            trainer = Trainer(cfg, dims)
            trainer.train()
            wait_for_all_ranks()
    except ConfigError as e:  # checks that need the model or the process group (e.g. TP vs. heads)
        print(f"titanium: config error: {e}", file=sys.stderr)
        return 2
    except UserError as e:
        print(f"titanium: error: {e}", file=sys.stderr)
        return 1
    finally:
        if trainer is not None:
            trainer.close()
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
