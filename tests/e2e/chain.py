"""The first link of the quick start's chain, shared by the end-to-end tests of SFT, DPO and GRPO: the debug model
pretrained for PRETRAIN_STEPS steps (train_configs/debug_model.toml). The run is deterministic for a seed, so the
tests of one session make it once (the ``pretrained_folder`` fixture) instead of once each."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import REPO, run_train

PRETRAIN_STEPS = 40


def pretrained(folder: Path, seed: int = 0) -> Path:
    """The step-PRETRAIN_STEPS checkpoint of debug_model.toml with ``seed``, made in ``folder`` unless it is
    there already (DCP writes ``.metadata`` last, so a half-written one is made again)."""
    dump = folder / f"pretrain_seed{seed}"
    checkpoint = dump / f"checkpoint/step-{PRETRAIN_STEPS}"
    if not (checkpoint / ".metadata").exists():
        run_train([
            "--job.config_file", str(REPO / "train_configs/debug_model.toml"), "--job.dump_folder", str(dump),
            "--job.no_print_config", "--debug.seed", str(seed),
            "--training.steps", str(PRETRAIN_STEPS), "--checkpoint.interval", str(PRETRAIN_STEPS),
        ], timeout=600)  # fmt: skip
    return checkpoint
