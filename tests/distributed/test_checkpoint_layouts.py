"""Checkpoints across layouts: resharding on load, seed checkpoints, and a clear error on DP changes.

Constant LR (no warmup, min factor 1) so a run cut at step 4 and continued to step 8 follows the same
schedule as one that ran 8 steps straight. Synthetic data, fp32; losses compared at 1e-5 relative.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.helpers import REPO, env, run_jobs, run_train, scalars, tiny_args

CONSTANT_LR = ("--lr_scheduler.warmup_steps", "0", "--lr_scheduler.min_lr_factor", "1.0")


def args(out, *extra):
    return tiny_args(out, "--data.kind", "synthetic", "--checkpoint.enable", *CONSTANT_LR, *extra)


SAVES = {  # name: the layout of the runs that save, at 2 processes
    "fsdp2": ("--training.local_batch_size", "2"),
    "pp2": ("--parallelism.pipeline_parallel_degree", "2"),
}
RESHARDS = {  # name: (the saved run it resumes, processes and layout of the resumed run)
    "fsdp2_to_hsdp2x1": (
        "fsdp2", 2, ("--training.local_batch_size", "2", "--parallelism.data_parallel_replicate_degree", "2"),
    ),
    "fsdp2_to_fsdp2_tp2": (
        "fsdp2", 4, ("--training.local_batch_size", "2", "--parallelism.tensor_parallel_degree", "2"),
    ),
    "pp2_to_single": ("pp2", 1, ()),
}  # fmt: skip


def test_checkpoint_resumes_at_another_layout(tmp_path):
    """Save at one layout at step 4, resume at another: steps 5-8 match the uninterrupted run.

    The data-parallel degree is kept (a data position belongs to one DP layout); sharding, tensor
    and pipeline parallelism change, and DCP reshards the model and optimizer on load. The runs that save go in
    one launch of 2 processes, once per saved layout; each resumed run is a launch of its own (a restarted job) in
    a copy of the cut run's folder.
    """
    interval = ("--checkpoint.interval", "4")
    saves = []
    for name, save_layout in SAVES.items():
        saves.append(args(tmp_path / name / "straight", *save_layout, *interval, "--training.steps", "8"))
        saves.append(args(tmp_path / name / "cut", *save_layout, *interval, "--training.steps", "4"))
    run_jobs(saves, 2, tmp_path / "saves.json")
    for name, (saved, load_nproc, load_layout) in RESHARDS.items():
        shutil.copytree(tmp_path / saved / "cut", tmp_path / name)
        resumed_args = args(tmp_path / name, *load_layout, *interval, "--training.steps", "8")
        result = run_train([*resumed_args, "--metrics.save_tb_folder", "tb_resumed"], nproc=load_nproc)
        assert "resuming at step 4" in result.stderr, name
        expected, resumed = scalars(tmp_path / saved / "straight/tb"), scalars(tmp_path / name / "tb_resumed")
        assert sorted(resumed) == [5, 6, 7, 8], name
        for step in resumed:
            assert resumed[step] == pytest.approx(expected[step], rel=1e-5), (name, step)


def test_seed_checkpoint_initializes_any_layout(tmp_path):
    seed, single, seed1, seed2 = (tmp_path / name for name in ("seeded", "single", "seed1", "seed2"))
    run_jobs(
        [
            args(seed, "--checkpoint.create_seed_checkpoint"),
            args(single, "--training.steps", "3", "--training.local_batch_size", "4", "--debug.seed", "7"),
            # The single-process reference of the seeded runs: its own seed checkpoint (default seed 0), then 3 steps.
            args(seed1, "--checkpoint.create_seed_checkpoint"),
            args(seed1, "--training.steps", "3", "--training.local_batch_size", "4"),
        ],
        1,
        tmp_path / "one.json",
    )
    assert (seed / "checkpoint/step-0/.metadata").is_file()
    assert not list((seed / "checkpoint/step-0").glob("__1_*"))  # model only: one process wrote it
    # Same job folder as the seed, 2 processes, another seed: weights must come from step-0. Then a seed checkpoint
    # written by a sharded job itself (FSDP over 2 processes).
    result = run_jobs(
        [
            args(seed, "--training.steps", "3", "--training.local_batch_size", "2", "--debug.seed", "0"),
            args(seed2, "--checkpoint.create_seed_checkpoint", "--training.local_batch_size", "2"),
        ],
        2,
        tmp_path / "two.json",
    )
    assert "loaded model from" in result.stderr and "step-0" in result.stderr
    run_train(args(seed2, "--training.steps", "3", "--training.local_batch_size", "4"))
    expected, got, sharded = scalars(seed1 / "tb"), scalars(seed / "tb"), scalars(seed2 / "tb")
    for step in (1, 2, 3):
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step
        assert sharded[step] == pytest.approx(expected[step], rel=1e-5), step  # the sharded seed: the same weights
    assert scalars(single / "tb")[1] != pytest.approx(got[1], rel=1e-6)  # a different seed really differs


def test_changing_dp_degree_needs_data_excluded(tmp_path):
    run_train(args(tmp_path, "--training.steps", "2", "--training.local_batch_size", "2"), nproc=2)
    cmd = [sys.executable, "-m", "titanium.train", *args(tmp_path, "--training.steps", "3")]
    failed = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert failed.returncode == 2
    assert "cannot load checkpoint" in failed.stderr and "exclude_from_loading" in failed.stderr
    assert "Traceback" not in failed.stderr
    result = run_train([*args(tmp_path, "--training.steps", "3"), "--checkpoint.exclude_from_loading", "data", "rng"])
    assert "resuming at step 2" in result.stderr


def test_initial_load_path_from_another_run(tmp_path):
    source, full, weights = tmp_path / "source", tmp_path / "full", tmp_path / "weights"
    step3 = str(source / "checkpoint/step-3")
    result = run_jobs(
        [
            args(source, "--training.steps", "6", "--checkpoint.interval", "3", "--debug.deterministic"),
            args(
                full,
                "--training.steps",
                "6",
                "--debug.deterministic",
                "--checkpoint.initial_load_path",
                step3,
                "--checkpoint.no_initial_load_model_only",
            ),
            args(weights, "--training.steps", "1", "--checkpoint.initial_load_path", step3),
        ],  # fmt: skip
        1,
        tmp_path / "jobs.json",
    )
    # The full load resumes at step 3; the model-only load (the last job) loads weights and does not resume.
    assert (
        result.stderr.count("resuming at step 3") == 1
        and "resuming" not in result.stderr.split("loaded model from")[-1]
    )
    expected, got = scalars(source / "tb"), scalars(full / "tb")
    assert [got[s] for s in (4, 5, 6)] == [expected[s] for s in (4, 5, 6)]
    assert scalars(weights / "tb")[1] < expected[1] - 0.1  # starts from trained weights
