"""Save and resume the training state with DCP, one folder per step, never a half-written one.

A save goes to `.step-N.partial/` and is renamed to `step-N/` by rank 0 only after every rank has
finished writing, so a folder named `step-N` is always complete: a run killed mid-save resumes from
the previous one. Older checkpoints are removed only after a newer one is complete.

Async saves run on their own gloo process group (training collectives on the default group would
collide with the background writer's) and at most one is in flight: the next save, and the end of
training, wait for the previous one.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from titanium.checkpoint.states import ModelPart, ModelState
from titanium.config.sections import CheckpointSection
from titanium.errors import UserError
from titanium.peft.lora import is_lora_param

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")
MODEL_KEY = "model"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be loaded; the message names the folder and the cause."""


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor values with weights_only=False; we never do."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def complete_steps(folder: Path) -> list[int]:
    """Steps with a complete checkpoint under `folder`, oldest first."""
    if not folder.is_dir():
        return []
    steps = []
    for path in folder.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / ".metadata").is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def checkpoint_problem(path: Path) -> str | None:
    """Why the DCP checkpoint folder ``path`` cannot be loaded, or None when its files are whole.

    Reads ``.metadata`` and compares each data file's size with the bytes the metadata places in it, so a
    missing or truncated file is found before loading, the same way on every rank. (DCP keeps no
    checksums: damaged bytes in a file of the right size show only when loading.)
    """
    if not path.is_dir():
        return "not found" if not path.exists() else "not a folder"
    if not (path / ".metadata").is_file():
        inside = complete_steps(path)
        hint = f" such as {path / f'step-{inside[-1]}'}" if inside else ""
        return (
            f"no .metadata, so not a titanium (DCP) checkpoint: point at a step-N folder{hint} (it holds .metadata "
            "and __*.distcp files), or add --checkpoint.initial_load_in_hf for a Hugging Face folder"
        )
    try:
        storage = dcp.FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as e:
        return f".metadata cannot be read ({type(e).__name__}: {e})"
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size < size:
            return f"{name} is truncated ({file.stat().st_size:,} bytes; .metadata places {size:,} bytes in it)"
    return None


def check_checkpoint(path: Path, flag: str) -> Path:
    """``path`` if it is a loadable checkpoint, else CheckpointError naming ``flag``, the folder and the problem."""
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(f"{flag}: checkpoint {path}: {problem}")
    return path


def model_mismatch(path: Path, model: dict[str, Any], part: ModelPart = "all") -> str | None:
    """Why the model weights of checkpoint ``path`` do not fit ``model`` (a model state dict, one-process names;
    sharded tensors count by their global shape; ``part``: which of the checkpoint's weights it loads, as
    ``ModelState``'s), or None: the tensors it lacks, those of another shape, and the checkpoint's tensors of that
    part the model has no place for (they would be dropped silently: DoRA's magnitudes read with a config without
    use_dora), read from ``.metadata`` before any loading, so a checkpoint of another architecture is named with its
    differences instead of failing inside DCP."""
    prefix = MODEL_KEY + "."
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved = {
        k[len(prefix) :]: tuple(v.size) for k, v in metadata.items() if k.startswith(prefix) and hasattr(v, "size")
    }
    missing = [name for name in model if name not in saved]
    wrong = [
        f"{name} {list(saved[name])} (the model's is {list(value.shape)})"
        for name, value in model.items()
        if name in saved and tuple(saved[name]) != tuple(value.shape)
    ]
    ours = {"all": lambda name: True, "trainable": is_lora_param, "base": lambda name: not is_lora_param(name)}[part]
    unexpected = [name for name in saved if name not in model and ours(name)]
    problems = [f"shape mismatch: {_few(wrong)}"] if wrong else []
    problems += [f"missing {_few(missing)}"] if missing else []
    problems += [f"tensors the model has no place for: {_few(unexpected)}"] if unexpected else []
    return "; ".join(problems) or None


def _few(items: list[str], shown: int = 4) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return "; ".join(items[:shown]) + more


CONFIGURED_MODEL = "point it at a checkpoint of the configured model (--model.name, --model.flavor), or change those"
"""The usual fix of a checkpoint that does not fit the model: the model is the job config's."""


def check_model_fits(
    path: Path, model: dict[str, Any], flag: str, part: ModelPart = "all", fix: str = CONFIGURED_MODEL
) -> None:
    """CheckpointError naming ``flag``, the folder, the differences and ``fix`` unless its model weights (of
    ``part``) fit ``model``."""
    problem = model_mismatch(path, model, part)
    if problem is not None:
        raise CheckpointError(f"{flag}: checkpoint {path} holds a model of another architecture ({problem}); {fix}")


def load_model_weights(
    path: Path, model: nn.Module, flag: str, part: ModelPart = "all", fix: str = CONFIGURED_MODEL
) -> None:
    """Load only the model weights of the titanium checkpoint ``path`` into ``model`` (a frozen copy: a reference,
    a teacher), through the same checks as a resumed policy: whole files, the same architecture. For a model
    built with its base frozen (LoRA), ``part`` "trainable" loads what a LoRA run's checkpoints hold (the
    adapters) and "base" the frozen weights (from a full checkpoint)."""
    check_checkpoint(path, flag)
    state = ModelState(model, part=part)
    check_model_fits(path, state.state_dict(), flag, part, fix)
    try:
        dcp.load({MODEL_KEY: state}, checkpoint_id=str(path), planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as e:  # (DCP's CheckpointException is a BaseException)
        raise CheckpointError(f"{flag}: cannot load the model weights of checkpoint {path}: {_root_causes(e)}") from e


def _root_causes(error: BaseException) -> str:
    """One line per failing rank instead of DCP's stack traces."""
    if isinstance(error, CheckpointException):
        return "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in error.failures.items())
    return f"{type(error).__name__}: {error}"


class CheckpointManager:
    def __init__(
        self, cfg: CheckpointSection, dump_folder: str, states: dict[str, Any], rank: int, base_model: Any = None
    ) -> None:
        """`states` maps top-level keys to Stateful objects; per-rank ones need per-rank keys
        ("data_dp3", "rng_rank5": DCP keeps a single copy of identically named values).

        `base_model` (LoRA) is the frozen part of the model, which this run's checkpoints leave out: it is
        read from a titanium initial_load_path on every start, resumed or not."""
        self.cfg, self.states, self.rank, self.base_model = cfg, states, rank, base_model
        self.folder = Path(dump_folder) / cfg.folder
        self._pending: tuple[int, Future] | None = None
        self._staging: Future | None = None
        self._pg = None
        self._stager = None
        self.last_blocking_s = 0.0
        if cfg.enable and cfg.async_mode != "disabled":
            self._pg = dist.new_group(backend="gloo")
        if cfg.enable and cfg.async_mode == "async_with_pinned_mem":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(cuda, True, cuda, cuda))

    # ----- resume -----

    def load(self) -> int:
        """Restore the newest (or `load_step`) checkpoint; returns its step, 0 when starting fresh.

        step-0 is a seed checkpoint: it holds only the model, and only the model is restored. A newest
        checkpoint with a missing, truncated or unreadable file is skipped with a warning naming it, and
        the previous one is loaded. Without a checkpoint of its own (or with checkpointing off) the run
        starts from initial_load_path, when that is a titanium checkpoint.
        """
        cfg = self.cfg
        initial = Path(cfg.initial_load_path) if cfg.initial_load_path and not cfg.initial_load_in_hf else None
        if self.base_model is not None and initial is not None:
            path = check_checkpoint(initial, "--checkpoint.initial_load_path")
            self._load(path, [MODEL_KEY], {MODEL_KEY: self.base_model})
        step = self._resume_step() if cfg.enable else None
        if step is None:
            return self._load_initial(initial) if initial is not None else 0
        keys = [MODEL_KEY] if step == 0 else [k for k in self.states if _kind(k) not in cfg.exclude_from_loading]
        self._load(self.folder / f"step-{step}", keys)
        return step

    def _resume_step(self) -> int | None:
        """The step to resume from: `load_step`, else the newest checkpoint whose files are whole; None if
        this run has none. Broken checkpoints only: CheckpointError (restarting from step 0 would quietly
        throw the run away)."""
        steps = complete_steps(self.folder)
        if self.cfg.load_step != -1:
            if self.cfg.load_step not in steps:
                raise CheckpointError(
                    f"--checkpoint.load_step {self.cfg.load_step}: no complete checkpoint "
                    f"{self.folder}/step-{self.cfg.load_step} (available: {steps or 'none'})"
                )
            check_checkpoint(self.folder / f"step-{self.cfg.load_step}", "--checkpoint.load_step")
            return self.cfg.load_step
        broken = []
        for step in reversed(steps):
            path = self.folder / f"step-{step}"
            problem = checkpoint_problem(path)
            if problem is None:
                return step
            broken.append(f"{path}: {problem}")
            if self.rank == 0:
                logger.warning("skipping checkpoint %s: %s; trying the previous one", path, problem)
        if broken:
            raise CheckpointError(
                f"no usable checkpoint to resume from ({'; '.join(broken)}); move the broken folders out of "
                f"{self.folder} to start this run over from step 0"
            )
        return None

    def _load_initial(self, path: Path) -> int:
        """Start from another run's checkpoint; only its weights unless initial_load_model_only is off."""
        path = check_checkpoint(path, "--checkpoint.initial_load_path")
        if self.base_model is not None:  # LoRA: the base is loaded; the adapters start fresh
            if self.cfg.initial_load_model_only:
                return 0
            keys = [k for k in self.states if k != MODEL_KEY and _kind(k) not in self.cfg.exclude_from_loading]
        elif self.cfg.initial_load_model_only:
            self._load(path, [MODEL_KEY])
            return 0
        else:
            keys = [k for k in self.states if _kind(k) not in self.cfg.exclude_from_loading]
        self._load(path, keys)
        return int(self.states["train_state"].step) if "train_state" in keys else 0

    def _load(self, path: Path, keys: list[str], states: dict[str, Any] | None = None) -> None:
        start = time.perf_counter()
        states = {**self.states, **(states or {})}
        keys = self._keys_in_checkpoint(path, keys)
        if MODEL_KEY in keys:
            flag = "--checkpoint.initial_load_path" if path.parent != self.folder else "resuming from --job.dump_folder"
            check_model_fits(path, states[MODEL_KEY].state_dict(), flag, states[MODEL_KEY].part)
        try:
            dcp.load({k: states[k] for k in keys}, checkpoint_id=str(path), planner=SafeLoadPlanner())
        except (Exception, CheckpointException) as e:  # (DCP's CheckpointException is a BaseException)
            raise CheckpointError(
                f"cannot load checkpoint {path} ({', '.join(keys)}): {_root_causes(e)}. If the world size or data "
                "changed, try --checkpoint.exclude_from_loading data rng; if its files are damaged, move the "
                "folder away to resume from the previous checkpoint"
            ) from e
        logger.info("loaded %s from %s in %.2fs", ", ".join(keys), path, time.perf_counter() - start)

    def _keys_in_checkpoint(self, path: Path, keys: list[str]) -> list[str]:
        """Drop per-rank state the checkpoint lacks because it was saved at another layout.

        A rank with no saved RNG keeps its fresh one (there is no right mapping between layouts); a
        missing data position is an error, since carrying on would silently repeat or skip data.
        """
        try:
            saved = {
                fqn.split(".", 1)[0] for fqn in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
            }
        except Exception as e:
            raise CheckpointError(f"cannot read checkpoint {path}/.metadata: {e}") from e
        kept = []
        for key in keys:
            if key in saved:
                kept.append(key)
            elif _kind(key) == "rng":
                logger.warning("%s has no %s (saved at another layout); this rank keeps a fresh RNG", path, key)
            elif _kind(key) == "data":
                raise CheckpointError(
                    f"{path} has no data position {key}: it was saved with another data-parallel degree; "
                    "keep the degree, or restart the data with --checkpoint.exclude_from_loading data rng"
                )
            else:
                raise CheckpointError(f"{path} has no '{key}' state; exclude it with --checkpoint.exclude_from_loading")
        return kept

    # ----- save -----

    def should_save(self, step: int, last_step: int) -> bool:
        return self.cfg.enable and (step % self.cfg.interval == 0 or step == last_step)

    def save(self, step: int, *, final: bool = False, model_only: bool = False) -> None:
        """Save `step`; async modes return once the state is captured. `final` waits for the write."""
        self.wait()
        partial = self.folder / f".step-{step}.partial"
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        dist.barrier()
        only_model = model_only or (final and self.cfg.last_save_model_only)
        state = {MODEL_KEY: self.states[MODEL_KEY]} if only_model else self.states
        start = time.perf_counter()
        mode = self.cfg.async_mode
        if mode == "disabled":
            dcp.save(state, checkpoint_id=str(partial))
            dist.barrier()
            future: Future = Future()
            future.set_result(None)
        elif mode == "async":
            future = dcp.async_save(
                state, checkpoint_id=str(partial), process_group=self._pg,
                async_checkpointer_type=AsyncCheckpointerType.THREAD,
            )  # fmt: skip
        else:
            response = dcp.async_save(
                state, checkpoint_id=str(partial), process_group=self._pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self._stager,
            )  # fmt: skip
            if isinstance(response, Future):
                future = response
            else:
                self._staging, future = response.staging_completion, response.upload_completion
        self._pending = (step, future)
        self.last_blocking_s = time.perf_counter() - start
        logger.info("checkpoint step-%d: loop blocked %.2fs (%s)", step, self.last_blocking_s, mode)
        if final or mode == "disabled":
            self.wait()

    def maybe_wait_for_staging(self) -> None:
        """Before the optimizer changes the weights, the staged copy must be complete."""
        if self._staging is not None:
            self._staging.result()
            self._staging = None

    def poll(self) -> None:
        """Publish a finished async save without waiting (cheap; call once per step)."""
        if self._pending is not None and self._pending[1].done():
            self.wait()

    def wait(self) -> None:
        """Wait for the save in flight, then publish it (rank 0 renames .partial -> step-N)."""
        if self._pending is None:
            return
        step, future = self._pending
        self._pending = None
        self.maybe_wait_for_staging()
        future.result()
        # DCP's finish step gathers every rank's write results before the coordinator (rank 0)
        # writes .metadata, so rank 0's future completing means all ranks' data is on disk.
        if self.rank == 0:
            final = self.folder / f"step-{step}"
            shutil.rmtree(final, ignore_errors=True)
            (self.folder / f".step-{step}.partial").rename(final)
            self._purge_old(keep=step)
            logger.info("checkpoint saved: %s", final)

    def _purge_old(self, keep: int) -> None:
        if self.cfg.keep_latest_k <= 0:
            return
        for old in complete_steps(self.folder)[: -self.cfg.keep_latest_k]:
            if old != keep:
                shutil.rmtree(self.folder / f"step-{old}", ignore_errors=True)

    def close(self) -> None:
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def _kind(key: str) -> str:
    """ "data_dp3" -> "data", "rng_rank0" -> "rng", "lr_scheduler" -> "lr_scheduler"."""
    for kind in ("data", "rng"):
        if key.startswith(kind + "_"):
            return kind
    return key
