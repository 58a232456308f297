"""The first links of the quick start's chain, shared by the end-to-end tests of SFT, DPO and GRPO: the debug model
pretrained for PRETRAIN_STEPS steps (train_configs/debug_model.toml), then fine-tuned for SFT_STEPS steps
(train_configs/debug_sft.toml). The runs are deterministic for a seed, so the tests of one session make each once
(in the ``pretrained_folder`` fixture's folder) instead of once per test."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import REPO, run_train

PRETRAIN_STEPS = 40
SFT_STEPS = 120


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


def fine_tuned(folder: Path, seed: int = 0) -> Path:
    """The step-SFT_STEPS checkpoint of debug_sft.toml from ``pretrained(folder, seed)``, made in ``folder`` unless
    it is there already: the policy DPO and GRPO start from (and DPO's reference), and the SFT test's run. Held-out
    exact match is evaluated before the first step and at the end (in ``tb/``; evaluation leaves training as it is:
    the logged losses are equal with and without it), and the run's console output is kept in ``stderr.log``."""
    dump = folder / f"sft_seed{seed}"
    checkpoint = dump / f"checkpoint/step-{SFT_STEPS}"
    if not (checkpoint / ".metadata").exists():
        result = run_train([
            "--job.config_file", str(REPO / "train_configs/debug_sft.toml"), "--job.dump_folder", str(dump),
            "--checkpoint.initial_load_path", str(pretrained(folder, seed)), "--job.no_print_config",
            "--debug.seed", str(seed), "--training.steps", str(SFT_STEPS), "--checkpoint.interval", str(SFT_STEPS),
            "--eval.interval", str(SFT_STEPS),
        ], timeout=600)  # fmt: skip
        (dump / "stderr.log").write_text(result.stderr)
    return checkpoint
