"""Shared test utilities: build a Trainer in-process, run the CLI, read logged scalars back."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]
LOSS_TAG = "loss_metrics/global_avg_loss"


def tiny_args(dump_folder: Path, *extra: str) -> list[str]:
    """CLI args for a fast run of the debug model (fp32, log every step, no config print)."""
    return [
        "--job.config_file", str(REPO / "train_configs/debug_model.toml"),
        "--job.dump_folder", str(dump_folder),
        "--job.no_print_config",
        "--training.seq_len", "64",
        "--training.local_batch_size", "4",
        "--training.mixed_precision_param", "float32",
        "--metrics.log_freq", "1",
        "--checkpoint.no_enable",
        *extra,
    ]  # fmt: skip


def env() -> dict[str, str]:
    return {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def train_cmd(args: list[str], nproc: int = 1, module: str = "titanium.train") -> list[str]:
    """titanium.train (or a test's wrapper ``module``) as a user would run it: plain python for 1 process,
    torchrun for more."""
    if nproc == 1:
        return [sys.executable, "-m", module, *args]
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", "-m", module, *args,
    ]  # fmt: skip


def run_train(
    args: list[str], nproc: int = 1, timeout: int = 300, module: str = "titanium.train"
) -> subprocess.CompletedProcess:
    """Run training to completion; fail the test with the end of stderr if it fails."""
    cmd = train_cmd(args, nproc, module)
    result = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"training failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


class Background:
    """A ``titanium.train`` run started in a process of its own, writing its console output (stderr) to ``log``,
    for a test that does other work meanwhile; ``wait`` collects it like ``run_train``."""

    def __init__(self, args: list[str], log: Path, nproc: int = 1, timeout: int = 300) -> None:
        self.log, self.deadline = log, time.monotonic() + timeout
        with log.open("w") as stderr:
            self.proc = subprocess.Popen(
                train_cmd(args, nproc), cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=stderr, text=True
            )

    def wait(self) -> str:
        """Wait for the run to end (within its timeout, counted from its start); its console output. Fails the
        test with the end of it if the run failed."""
        try:
            code = self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        if code != 0:
            raise AssertionError(f"training failed ({code}):\n{self.log.read_text()[-4000:]}")
        return self.log.read_text()

    def stop(self) -> None:
        """End the run if it is still going (a test that failed or a session that ended before waiting for it):
        SIGTERM first, which torchrun passes on to its workers."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_jobs(jobs: list[list[str]], nproc: int, jobs_file: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run several ``titanium.train`` argument lists one after the other in ONE launch of ``nproc`` processes
    (tests/distributed/jobs_worker.py): one interpreter and torchrun start for the lot instead of one per job.
    ``jobs_file`` is where the list is written. Fails the test with the end of stderr if a job fails."""
    jobs_file.write_text(json.dumps(jobs))
    cmd = train_cmd([str(jobs_file)], nproc, module="tests.distributed.jobs_worker")
    result = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"jobs {jobs_file.name} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


def scalars(tb_dir: Path, tag: str = LOSS_TAG) -> dict[int, float]:
    """step -> value of one scalar tag from the TensorBoard events a run wrote."""
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def scalar_tags(tb_dir: Path) -> list[str]:
    """The scalar tags a run wrote."""
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return list(acc.Tags()["scalars"])


def texts(tb_dir: Path, tag: str) -> dict[int, str]:
    """step -> the text a run wrote under ``tag`` (``add_text``, e.g. a table of samples)."""
    acc = EventAccumulator(str(tb_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(f"{tag}/text_summary")}


def load_script(path: str) -> ModuleType:
    """Import a script of the repository that is not in a package (scripts/, benchmarks/) by its path."""
    name = Path(path).stem
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


def train_until_first_save(make_trainer, *args: str, at_step: int | None = None) -> None:
    """Build a Trainer from ``args`` and let it die right after its first checkpoint (or its checkpoint of
    ``at_step``), as a killed job would."""
    import pytest

    from titanium.parallel.distributed import shutdown_distributed

    interrupted = make_trainer(*args)
    save = interrupted.checkpointer.save

    def save_then_die(step: int, **kwargs) -> None:
        save(step, **kwargs)
        if at_step is None or step == at_step:
            raise KeyboardInterrupt

    interrupted.checkpointer.save = save_then_die
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    interrupted.close()
    shutdown_distributed()


class LocalModels:
    """``ObjectiveContext.models`` for an objective tested in one process: the frozen model is ``reference()``,
    made when first run (so a test can tell whether it ever was), and the policy is ``policy`` (a llama3 model of
    ``policy_args``)."""

    def __init__(self, reference=None, policy=None, identity: str = "reference A", policy_args=None) -> None:
        self.reference, self._policy, self.id, self.policy_args = reference, policy, identity, policy_args
        self.released = 0
        self._policy_handle: LocalModels._Policy | None = None

    def frozen(self, *, keep=(), source=None) -> LocalModels._Frozen:
        return LocalModels._Frozen(self)

    def policy(self) -> LocalModels._Policy:
        if self._policy_handle is None:
            self._policy_handle = LocalModels._Policy(self._policy, self.policy_args)
        return self._policy_handle

    class _Frozen:
        def __init__(self, models: LocalModels) -> None:
            self.models, self.id, self.module = models, models.id, None

        def __call__(self, batch):
            return self._run(batch)

        def hidden(self, batch):
            return self._run(batch, project=False)

        def projection(self):
            if self.module is None:
                self.module = self.models.reference()
            output = self.module.output
            return output.weight.detach().clone(), getattr(output, "logit_softcap", None)

        def _run(self, batch, **kwargs):
            import torch

            if self.module is None:
                self.module = self.models.reference()
            with torch.no_grad():
                return self.module(**batch.model_inputs(), **kwargs)

        def release(self) -> None:
            self.module = None
            self.models.released += 1

    class _Policy:
        """One process, no parallelism: ``on_update`` follows the weights at once (they are in place) and then
        whenever the test calls ``updated(step)``, as the loop does after an optimizer step."""

        def __init__(self, model, args) -> None:
            import torch

            from titanium.models import get_model_spec

            self.model, self.pp_group, self.tp_group, self.param_dtype = model, None, None, torch.float32
            self.spec, self.args = get_model_spec("llama3"), args
            self.followers: list = []

        def on_update(self, function) -> None:
            self.followers.append(function)
            function(0)

        def updated(self, step: int) -> None:
            for function in self.followers:
                function(step)

        def forward(self, inputs):
            import torch

            with torch.no_grad():
                return self.model(**inputs)

        def lend(self):
            import contextlib

            import torch

            @contextlib.contextmanager
            def lent():
                self.model.eval()
                with torch.no_grad():
                    yield self.model
                self.model.train()

            return lent()


def split_sections(settings: dict[str, Any], *sections: type) -> list[Any]:
    """``settings`` (key -> value) split over config section dataclasses by their fields, e.g. GRPO's keys over
    ``GRPOSection`` and ``RLSection``: one instance of each, in order."""
    names = [{f.name for f in dataclasses.fields(cls)} for cls in sections]
    unknown = set(settings) - set().union(*names)
    assert not unknown, f"no section has {sorted(unknown)}"
    return [cls(**{k: v for k, v in settings.items() if k in fields}) for cls, fields in zip(sections, names)]
