"""Checkpoints survive SIGKILL: exact resume after a kill, and a kill during an async save.

Each case runs the CLI as a user would, kills the whole process group, then resumes with the same
command and compares per-step losses (from TensorBoard) with an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO, Background, env, run_train, scalars, tiny_args, train_cmd


def run_until(args: list[str], nproc: int, marker: str, timeout: float = 240) -> None:
    """Start training and SIGKILL every process of it as soon as a log line contains `marker`."""
    proc = subprocess.Popen(
        train_cmd(args, nproc),
        cwd=REPO,
        env=env(),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if marker in line:
                kill_tree(proc.pid)
                break
        else:
            raise AssertionError(f"run ended before {marker!r}:\n{''.join(seen[-30:])}")
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
        proc.wait(timeout=timeout)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants at once, like a machine losing power.

    (torchrun starts its workers in sessions of their own, so killing its process group is not enough.)
    """
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("nproc, rel", [(1, 0.0), (2, 1e-6)], ids=["single-bitwise", "fsdp2"])
def test_killed_run_resumes_exactly(tmp_path, nproc, rel):
    common = [
        "--training.steps", "20", "--checkpoint.enable", "--checkpoint.interval", "10",
        "--debug.deterministic", "--training.local_batch_size", str(4 // nproc),
    ]  # fmt: skip
    # The uninterrupted run goes side by side with the killed one and its resumption (on a 2-core machine, in about
    # the time of one of them): nothing of it reaches the other folder.
    straight = Background(tiny_args(tmp_path / "straight", *common), tmp_path / "straight.log", nproc=nproc)
    killed = tiny_args(tmp_path / "killed", *common)
    try:
        run_until(killed, nproc, marker="step   12/20")
        assert (tmp_path / "killed/checkpoint/step-10/.metadata").is_file()
        run_train([*killed, "--metrics.save_tb_folder", "tb_resumed"], nproc=nproc)
        straight.wait()
    finally:
        straight.stop()
    expected = scalars(tmp_path / "straight/tb")
    resumed = scalars(tmp_path / "killed/tb_resumed")
    assert sorted(resumed) == list(range(11, 21))
    for step in resumed:
        if rel == 0.0:
            assert resumed[step] == expected[step], (step, resumed[step], expected[step])
        else:
            assert resumed[step] == pytest.approx(expected[step], rel=rel), step


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_kill_during_async_save_resumes_from_previous(tmp_path, mode):
    args = tiny_args(
        tmp_path, "--training.steps", "8", "--checkpoint.enable", "--checkpoint.interval", "2",
        "--checkpoint.async_mode", mode,
    )  # fmt: skip
    run_until(args, 1, marker="checkpoint step-4: loop blocked")
    folder = tmp_path / "checkpoint"
    assert (folder / "step-2/.metadata").is_file()
    assert not (folder / "step-4").exists(), "the save in flight must not look complete"
    result = run_train([*args, "--metrics.save_tb_folder", "tb_resumed"])
    assert "loaded model, optimizer" in result.stderr and "step-2" in result.stderr
    assert sorted(scalars(tmp_path / "tb_resumed")) == list(range(3, 9))
    assert (folder / "step-8/.metadata").is_file()
    assert not list(folder.glob(".*partial")) or (folder / ".step-4.partial").exists()
