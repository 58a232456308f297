"""vLLM in server mode: the engine in a process of its own, fed prompts and weights without touching disk.

Each training process that builds the engine (one per data-parallel rank: GRPO gives every rank its own prompts;
with ``--rollout.server_per node`` / ``job`` only the first rank of each machine / of the job, serving its ranks:
``vllm_shared``) starts one engine process (a ``spawn`` child) that owns a colocated ``VLLMEngine`` in its own
single-process torch.distributed group, so vLLM's process-wide state (threads, memory binding, its default group)
stays out of the trainer. The two talk over a pipe: requests (generate, load a block, finish a sync, close) go one
at a time and every request waits for its answer, so a block's values are loaded before the trainer gathers the
next one.

Weights (CPU): each weight gets a shared-memory buffer the first time it is synced, handed to the engine process
once; every sync copies the gathered block into its buffers and names them, and the engine process hands the
buffers to ``VLLMEngine.load_weights`` (the family's adapter names, ``reload_weights``; ``finish_sync`` resets the
prefix cache). GPU: the transfer would be a NCCL broadcast from the trainer's rank into the engine process's own
GPU buffers in ``_publish`` instead of shared memory; that is not built, so the server mode refuses CUDA.

The engine process ends with ``close`` (it closes vLLM and exits), when the trainer's process exits without
closing (a finalizer, and as a daemon multiprocessing terminates it; SIGTERM closes vLLM), and when the trainer's
process dies (its pipe closes, or the parent is gone at the next one-second check).
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import os
import signal
import sys
import traceback
import weakref
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing as mp

from titanium.config.loader import ConfigError
from titanium.config.sections import RolloutSection
from titanium.errors import UserError
from titanium.generation.engine import RolloutEngine, Rollouts
from titanium.generation.sampling import SamplingParams
from titanium.models.spec import ModelSpec

logger = logging.getLogger(__name__)

STOP_SECONDS = 60.0
"""How long ``close`` waits for the engine process to close vLLM and exit before terminating it."""


class VLLMServerEngine(RolloutEngine):
    background = True  # (generation runs in the engine process; a generation thread only waits for its answer)

    def __init__(self, spec: ModelSpec, args: Any, cfg: RolloutSection, *, device_type: str, **options: Any) -> None:
        """``options``: ``VLLMEngine``'s (stop ids, pad id, max_model_len, dtype, seed), for the engine process."""
        check_server(device_type)
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(
            target=serve,
            args=(child, spec, args, cfg, {**options, "device_type": device_type}),
            name="titanium-vllm-server",
            daemon=True,
        )
        self.process.start()
        child.close()
        logger.info("vLLM engine process %d started (--rollout.mode server)", self.process.pid)
        self._stop = weakref.finalize(self, stop, self.process, self._conn)
        self._buffers: dict[str, torch.Tensor] = {}
        self._answer()  # the engine is up (or its error, raised here)

    def _request(self, op: str, payload: Any = None) -> Any:
        self._conn.send((op, payload))
        return self._answer()

    def _answer(self) -> Any:
        while not self._conn.poll(1.0):
            if not self.process.is_alive() and not self._conn.poll(0):
                raise RuntimeError(f"the vLLM engine process exited (exit code {self.process.exitcode})")
        status, value = self._conn.recv()
        if status == "error":
            raise value
        return value

    def _publish(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Put ``weights`` where the engine process reads them: each one's shared-memory buffer (made at its first
        sync; the new ones returned, to hand over once). A GPU transfer would broadcast over NCCL here."""
        new = {}
        with torch.no_grad():
            for name, value in weights.items():
                if name not in self._buffers:
                    self._buffers[name] = new[name] = torch.empty(value.shape, dtype=value.dtype).share_memory_()
                self._buffers[name].copy_(value)
        return new

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._request("load", (list(weights), self._publish(weights)))

    def finish_sync(self, version: int) -> None:
        self._request("finish_sync", version)
        self.version = version

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> Rollouts:
        return self.generate_many([(prompts, seed)], params)[0]

    def generate_many(
        self, requests: Sequence[tuple[Sequence[Sequence[int]], int]], params: SamplingParams
    ) -> list[Rollouts]:
        """``VLLMEngine.generate_many`` in the engine process: several callers' prompts in one request."""
        self.synced_version()
        return self._request("generate", ([([list(p) for p in prompts], seed) for prompts, seed in requests], params))

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(engine, *args)`` on the ``VLLMEngine`` in the engine process (``fn`` importable by name: it is
        pickled by reference); what it returns comes back. Tests read vLLM's prompt log-probs through it."""
        return self._request("call", (fn, args))

    def close(self) -> None:
        self._stop()


def check_server(device_type: str) -> None:
    """What server mode needs in the trainer's process: a CPU job (no NCCL path yet) and vLLM installed."""
    from titanium.generation.vllm_engine import INSTALL

    if device_type != "cpu":
        raise ConfigError(
            f"--rollout.mode server runs on CPU only so far (weights go through shared memory; the NCCL path for "
            f"{device_type} is not built): use --rollout.mode colocated"
        )
    if importlib.util.find_spec("vllm") is None:
        raise UserError(f"--rollout.engine vllm needs vLLM, which is not installed here: {INSTALL}")


def stop(process: multiprocessing.Process, conn: Connection) -> None:
    """End the engine process: ask it to close, then terminate and kill it if it does not exit in time."""
    try:
        conn.send(("close", None))
    except OSError:  # (it is gone already)
        pass
    process.join(STOP_SECONDS)
    if process.is_alive():
        logger.warning("vLLM engine process %d did not exit %g s after close: terminated", process.pid, STOP_SECONDS)
        process.terminate()
        process.join(10)
    if process.is_alive():
        process.kill()
        process.join()
    conn.close()


def serve(conn: Connection, spec: ModelSpec, args: Any, cfg: RolloutSection, options: dict[str, Any]) -> None:
    """The engine process: a ``VLLMEngine`` of its own, answering the trainer's requests until told to close or
    the trainer is gone."""
    from titanium.generation.vllm_engine import VLLMEngine, free_port

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # (so that vLLM is closed on the way out)
    # its own one-process group: the trainer's torchrun variables name the training job, not this process (and
    # under torchrun, the agent's store flag would make it wait for a store at its own port that nobody serves)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    os.environ.update(LOCAL_WORLD_SIZE="1", GROUP_RANK="0", GROUP_WORLD_SIZE="1")
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        engine = VLLMEngine(spec, args, cfg, **options)
    except BaseException as e:
        conn.send(("error", portable(e)))
        return
    conn.send(("ok", None))
    buffers: dict[str, torch.Tensor] = {}
    parent = multiprocessing.parent_process()
    try:
        while True:
            if not conn.poll(1.0):
                if parent is not None and not parent.is_alive():
                    break
                continue
            try:
                op, payload = conn.recv()
            except EOFError:  # the trainer's end of the pipe is closed
                break
            if op == "close":
                break
            try:
                conn.send(("ok", handle(engine, buffers, op, payload)))
            except Exception as e:
                conn.send(("error", portable(e)))
    finally:
        engine.close()


def handle(engine: Any, buffers: dict[str, torch.Tensor], op: str, payload: Any) -> Any:
    if op == "load":
        names, new = payload
        buffers.update(new)
        return engine.load_weights({name: buffers[name] for name in names})
    if op == "finish_sync":
        return engine.finish_sync(payload)
    if op == "generate":
        return engine.generate_many(*payload)
    if op == "call":
        fn, args = payload
        return fn(engine, *args)
    raise ValueError(f"unknown request {op!r}")


def portable(error: BaseException) -> BaseException:
    """What the trainer raises for an error in the engine process: a user error as it is (one message, exit 2),
    anything else as a RuntimeError carrying the engine process's traceback."""
    if isinstance(error, UserError):
        return error
    return RuntimeError("in the vLLM engine process:\n" + "".join(traceback.format_exception(error)))
