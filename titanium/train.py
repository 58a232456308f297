"""Entry point: `python -m titanium.train` or `torchrun --nproc_per_node N -m titanium.train`."""

from __future__ import annotations

import logging
import os
import sys

from titanium.config import ConfigError, load_config
from titanium.errors import UserError
from titanium.optim.in_backward import check_in_backward
from titanium.parallel.dims import ParallelDims
from titanium.parallel.distributed import shutdown_distributed, wait_for_all_ranks


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
        if cfg.checkpoint.create_seed_checkpoint and world_size != 1:
            raise ConfigError(
                f"--checkpoint.create_seed_checkpoint runs in one process (NGPU=1); it was started with {world_size}"
            )
        dims = ParallelDims.from_config(cfg.parallelism, world_size)
        check_in_backward(cfg.optimizer, cfg.training, dp_degree=dims.dp_degree, pp_degree=dims.pp)
    except ConfigError as e:
        print(f"titanium: config error: {e}", file=sys.stderr)
        return 2

    from titanium.trainer import Trainer  # after config checks: torch-heavy imports only for real runs

    trainer = None
    try:
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
