"""torchft on loopback: a replica group dies and comes back while the other trains on.

Two replica groups of the debug model (one process each, separate torchrun jobs of ft_worker.py) under a torchft
lighthouse on a free loopback port. Group 1 SIGKILLs itself in step 6, after its backward and before the
cross-group all-reduce, and is restarted as soon as group 0 has committed step 6 alone. Checked:

- group 0 never stops: it exits 0 after all STEPS steps, with 2 groups in steps 1-5, alone from step 6 to the
  step S at which group 1 healed, with 2 groups again after S (fault_tolerance/replica_groups, logged each step),
  and exactly one step repeated (step 6, whose all-reduce broke);
- the restarted group 1 heals from group 0 at S > 0 (weights, optimizer, LR schedule, step), skips its own data
  shard ahead to step S (S microbatches: it reads what it would have read had it never died), and both end with
  bitwise equal weights: after the heal they apply the same averaged gradients, so any difference in the copied
  weights or optimizer moments would persist to the end;
- group 0's losses in steps 6..S equal, bitwise, those of a reference run of group 0 alone (the same flags, its
  own lighthouse, group 1 never started) resumed from group 0's checkpoint of step 5. (A run alone from step 1
  would differ: in steps 1-5 the gradients were averaged with group 1's.) So dropping a group and repeating the
  step it broke, on the same microbatches, leaves the survivor's training exactly as if it had been alone.

The same scenario runs GRPO (sampled rollouts from each group's titanium engine, old log-probs recomputed): the
retried step reuses its rollouts (survivor bitwise equal to the reference again, whose resumed run samples the
batch of step 6 anew from the same prompts, seeds and weights), the rejoined group skips S rollout batches of its
own prompts, and its engine samples from the healed weights: the engine/trainer log-prob gap of its every batch
stays at float32 rounding (an engine left with the initial weights is far off).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, env, scalars

pytest.importorskip("torchft")

STEPS = 80
KILLED_IN_STEP = 6
ALONE_STEP_SECONDS = 0.5
"""Group 0's pace while alone: the restarted group must rejoin before it ends (its start-up takes 10-30 s on 2 busy
cores: up to (STEPS - KILLED_IN_STEP) x 0.5 s = 37 s here)."""
WORKER = "tests.distributed.ft_worker"  # (a module: GRPO's reward function is imported from tests/)
GROUPS_TAG = "fault_tolerance/replica_groups"
PRETRAIN = ("--training.seq_len", "32", "--training.local_batch_size", "2")
GRPO = (
    "--training.objective", "grpo", "--data.kind", "chat", "--data.path", "assets/tasks/arithmetic/train.jsonl",
    "--chat.chat_template", "llama3", "--grpo.group_size", "4", "--rl.max_new_tokens", "8",
    "--rl.max_prompt_len", "40", "--rl.rewards", "tests.objectives.fixed_rollouts:characters",
    "--grpo.old_logprobs", "recompute", "--training.seq_len", "48", "--training.local_batch_size", "8",
)  # fmt: skip
MISMATCH_BOUND = 1e-4
"""Largest engine/trainer log-prob gap of the rejoined group's batches (float32): measured 4.8e-7; 8.2 with its engine
left at the initial weights (no sync after the heal)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Group:
    """One replica group: a torchrun job of ft_worker.py, logging to a file the test reads as it goes."""

    def __init__(
        self, tmp: Path, name: str, replica_id: int, lighthouse: str, *extra: str, nproc: int = 1, **knobs: str
    ) -> None:
        """``extra``: the job's flags (the objective, batch and length among them) and the test's own."""
        self.log, self.weights = tmp / f"{name}.log", tmp / f"{name}.pt"
        args = [
            "--job.config_file", str(REPO / "train_configs/debug_model.toml"),
            "--job.dump_folder", str(tmp / name),
            "--job.no_print_config",
            "--training.steps", str(STEPS),
            "--training.mixed_precision_param", "float32",
            "--metrics.log_freq", "1",
            "--fault_tolerance.enable",
            "--fault_tolerance.group_size", "2",
            "--fault_tolerance.replica_id", str(replica_id),
            "--fault_tolerance.lighthouse", lighthouse,
            "--fault_tolerance.hostname", "127.0.0.1",
            "--fault_tolerance.timeout_seconds", "10",
            *extra,
        ]  # fmt: skip
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
            "--rdzv_endpoint=localhost:0", "-m", WORKER, *args,
        ]  # fmt: skip
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, env={**env(), "FT_WEIGHTS_OUT": str(self.weights), **knobs}, stdout=log, stderr=log
            )

    def wait_for(self, pattern: str, after: int = 0, timeout: float = 60) -> re.Match:
        """The first match of ``pattern`` in the log from offset ``after`` on, waiting for it to appear."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.compile(pattern).search(self.log.read_text(), after)
            if match:
                return match
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{self.log.name}: no {pattern!r}:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL the worker (torchrun puts it in a session of its own); its torchrun then exits."""
        pid_file = Path(f"{self.weights}.pid")
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
        try:
            self.proc.wait(timeout=30)
        finally:
            self.proc.kill()

    def finish(self, timeout: float = 120) -> None:
        assert self.proc.wait(timeout=timeout) == 0, f"{self.log.name} failed:\n{self.log.read_text()[-3000:]}"


def _lighthouse(join_timeout_ms: int = 5000) -> tuple[subprocess.Popen, str]:
    """A torchft lighthouse on a free loopback port, and its address. It waits up to ``join_timeout_ms`` for a
    group that is alive but not yet asking (so both groups start together) and drops one silent for 2 s."""
    port = _free_port()
    cmd = [
        str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", "1", "--quorum_tick_ms", "100",
        "--join_timeout_ms", str(join_timeout_ms), "--heartbeat_timeout_ms", "2000", "--bind", f"127.0.0.1:{port}",
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("objective", ["pretrain", "grpo"])
def test_a_killed_group_rejoins_and_the_survivor_trains_as_if_alone(tmp_path, objective):
    kill_and_rejoin(tmp_path, nproc=1, job=GRPO if objective == "grpo" else PRETRAIN)


def kill_and_rejoin(tmp_path: Path, nproc: int, job: tuple[str, ...] = PRETRAIN) -> None:
    """The scenario of the module docstring, with ``nproc`` processes (FSDP) in each replica group, running
    ``job`` (PRETRAIN or GRPO)."""
    started: list[Group] = []
    lighthouses = [_lighthouse(), _lighthouse()]  # the groups' and the reference's: the reference is alone

    def start(name: str, replica_id: int, *extra: str, **knobs: str) -> Group:
        lighthouse = lighthouses[name == "reference"][1]
        started.append(Group(tmp_path, name, replica_id, lighthouse, *job, *extra, nproc=nproc, **knobs))
        return started[-1]

    checkpoints = ("--checkpoint.enable", "--checkpoint.interval", str(KILLED_IN_STEP - 1))
    try:
        together = str(tmp_path / "started")
        survivor = start(
            "group0", 0, *checkpoints, FT_ALONE_STEP_SECONDS=str(ALONE_STEP_SECONDS), FT_START_TOGETHER=together
        )
        victim = start("group1", 1, FT_DIE_IN_STEP=str(KILLED_IN_STEP), FT_START_TOGETHER=together)
        resume_from = f"step-{KILLED_IN_STEP - 1}"  # copied at once: group 0 keeps only its 2 newest checkpoints
        survivor.wait_for(f"checkpoint saved: .*{resume_from}\\n")
        shutil.copytree(tmp_path / "group0/checkpoint" / resume_from, tmp_path / "reference/checkpoint" / resume_from)
        assert victim.proc.wait(timeout=60) != 0
        survivor.wait_for(rf"1 replica group\(s\) in step {KILLED_IN_STEP}\b")
        rejoined = start("group1_restarted", 1)
        reference = start("reference", 0, "--checkpoint.enable", "--checkpoint.interval", str(STEPS))
        healed_at = int(rejoined.wait_for(r"healed from a live replica group at step (\d+)", timeout=90).group(1))
        if job == GRPO:  # its own prompts of S rollout batches (of 2 prompts: 8 responses, groups of 4)
            rejoined.wait_for(rf"skipped {2 * healed_at} prompts \({healed_at} rollout batches\) of this rank's shard")
        else:  # its own shard's microbatches of S steps
            rejoined.wait_for(f"skipped {healed_at} microbatches of this group's data shard")
        reference.wait_for(f"resuming at step {KILLED_IN_STEP - 1} ")
        for group in (survivor, rejoined, reference):
            group.finish()

        groups = scalars(tmp_path / "group0/tb", GROUPS_TAG)
        assert sorted(groups) == list(range(1, STEPS + 1))
        assert {groups[s] for s in range(1, KILLED_IN_STEP)} == {2}, groups
        assert {groups[s] for s in range(KILLED_IN_STEP, healed_at + 1)} == {1}, (healed_at, groups)
        assert {groups[s] for s in range(healed_at + 1, STEPS + 1)} == {2}, (healed_at, groups)
        assert scalars(tmp_path / "group0/tb", "fault_tolerance/retried_steps")[STEPS] == 1

        survivor_weights, rejoined_weights = torch.load(survivor.weights), torch.load(rejoined.weights)
        assert survivor_weights.keys() == rejoined_weights.keys()
        for name, tensor in survivor_weights.items():
            assert torch.equal(tensor, rejoined_weights[name]), name

        losses, reference_losses = scalars(tmp_path / "group0/tb"), scalars(tmp_path / "reference/tb")
        alone = range(KILLED_IN_STEP, healed_at + 1)
        assert [losses[s] for s in alone] == [reference_losses[s] for s in alone]
        if job == GRPO:  # the rejoined group's engine sampled from the healed weights
            gap = scalars(tmp_path / "group1_restarted/tb", "grpo/logprob_mismatch_max")
            assert sorted(gap) == list(range(healed_at + 1, STEPS + 1)), sorted(gap)
            print(f"healed at {healed_at}; largest engine/trainer gap after: {max(gap.values()):.3g}")
            assert max(gap.values()) < MISMATCH_BOUND, gap
    finally:
        for group in started:
            if group.proc.poll() is None:
                group.kill()
        for lighthouse, _ in lighthouses:
            lighthouse.kill()


def test_local_sgd_averages_the_groups_weights_at_each_sync(tmp_path):
    """semi_sync_method local_sgd, sync_steps 3, 3 steps: each group takes 3 optimizer steps on its own shard,
    then the groups average their weights once. Reference: each group alone (its own lighthouse, so its "average"
    is itself) gives its weights P0, P1; the pair must end with (P0 + P1) / 2 in both groups, bitwise (the
    all-reduce adds two float32 numbers, then divides by 2, as the reference does), and before the sync each
    group's losses must be those of its lone run."""
    steps = ("--training.steps", "3", "--fault_tolerance.semi_sync_method", "local_sgd")
    steps += ("--fault_tolerance.sync_steps", "3")
    lighthouses = [_lighthouse(join_timeout_ms=30_000) for _ in range(3)]  # the pair's, and one per lone run
    runs = [Group(tmp_path, f"pair{g}", g, lighthouses[0][1], *PRETRAIN, *steps) for g in (0, 1)] + [
        Group(tmp_path, f"alone{g}", g, lighthouses[1 + g][1], *PRETRAIN, *steps) for g in (0, 1)
    ]
    try:
        for run in runs:
            run.finish()
        pair0, pair1, alone0, alone1 = (torch.load(run.weights) for run in runs)
        for name, alone in alone0.items():
            assert not torch.equal(alone, alone1[name]) or alone.dim() == 1, name  # (shards differ: a real test)
            assert torch.equal(pair0[name], (alone + alone1[name]) / 2), name
            assert torch.equal(pair1[name], pair0[name]), name
        for g in (0, 1):
            assert scalars(tmp_path / f"pair{g}/tb") == scalars(tmp_path / f"alone{g}/tb")
            assert scalars(tmp_path / f"pair{g}/tb", GROUPS_TAG)[3] == 2
    finally:
        for run in runs:
            if run.proc.poll() is None:
                run.kill()
        for lighthouse, _ in lighthouses:
            lighthouse.kill()
