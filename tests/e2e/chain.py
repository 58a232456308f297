"""The quick start's chain, shared by the end-to-end tests of pretraining, SFT, DPO and GRPO: the debug model
pretrained for PRETRAIN_STEPS steps (train_configs/debug_model.toml), fine-tuned for SFT_STEPS steps
(train_configs/debug_sft.toml), then DPO (train_configs/debug_dpo.toml) for DPO_STEPS steps and GRPO
(train_configs/debug_grpo.toml) for GRPO_STEPS steps, each from the SFT checkpoint. The runs are deterministic for a
seed, so the tests of one session make each once (in the ``pretrained_folder`` fixture's folder) instead of once per
test. DPO and GRPO need nothing from each other: ``start`` runs them in the background, so that a test session starts
both at once and a 2-core machine makes them side by side (each run has one thread) in the time of the longer."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import REPO, Background, run_train

PRETRAIN_STEPS = 40
PRETRAIN_INTERVAL = 25
"""Checkpoints at step 25 and at the last step (40, off the interval): tests/e2e/test_train_cli.py checks both."""
SFT_STEPS = 120
DPO_STEPS = 60
GRPO_STEPS = 40


def pretrained(folder: Path, seed: int = 0) -> Path:
    """The step-PRETRAIN_STEPS checkpoint of debug_model.toml with ``seed``, made in ``folder`` unless it is
    there already (DCP writes ``.metadata`` last, so a half-written one is made again). Run as a user runs the
    default job but for its steps and checkpoint interval; the console output is kept in ``stderr.log``."""
    dump = folder / f"pretrain_seed{seed}"
    checkpoint = dump / f"checkpoint/step-{PRETRAIN_STEPS}"
    if not (checkpoint / ".metadata").exists():
        result = run_train([
            "--job.config_file", str(REPO / "train_configs/debug_model.toml"), "--job.dump_folder", str(dump),
            "--debug.seed", str(seed), "--training.steps", str(PRETRAIN_STEPS),
            "--checkpoint.interval", str(PRETRAIN_INTERVAL),
        ], timeout=600)  # fmt: skip
        (dump / "stderr.log").write_text(result.stderr)
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


def dpo_config(folder: Path, seed: int = 0) -> list[str]:
    """debug_dpo.toml from ``fine_tuned(folder, seed)``, the DPO run's policy and frozen reference (the arguments
    titanium.tools.eval_preference is given too)."""
    return [
        "--job.config_file", str(REPO / "train_configs/debug_dpo.toml"),
        "--checkpoint.initial_load_path", str(fine_tuned(folder, seed)),
    ]  # fmt: skip


def start(kind: str, folder: Path, seed: int = 0) -> tuple[Path, Background]:
    """Start the ``kind`` ("dpo" or "grpo") run of ``seed`` from ``fine_tuned(folder, seed)`` (made first, in the
    foreground) in ``folder/<kind>_seed<seed>``: that folder and the run. Both evaluate held-out exact match at
    step 0 and at the end; GRPO logs every step."""
    common = ["--job.no_print_config", "--debug.seed", str(seed)]
    dump = folder / f"{kind}_seed{seed}"
    if kind == "dpo":
        args = [*dpo_config(folder, seed), "--training.steps", str(DPO_STEPS), "--checkpoint.interval", str(DPO_STEPS),
                "--eval.interval", str(DPO_STEPS)]  # fmt: skip
    else:
        args = [
            "--job.config_file", str(REPO / "train_configs/debug_grpo.toml"),
            "--checkpoint.initial_load_path", str(fine_tuned(folder, seed)), "--training.steps", str(GRPO_STEPS),
            "--checkpoint.interval", str(GRPO_STEPS), "--eval.interval", str(GRPO_STEPS), "--metrics.log_freq", "1",
        ]  # fmt: skip
    dump.mkdir(parents=True, exist_ok=True)
    return dump, Background([*args, "--job.dump_folder", str(dump), *common], dump / "stderr.log", timeout=900)
