"""Flight Recorder: every rank keeps its last collectives; when one hangs, every rank writes them down.

torch records each collective (op, sizes, process group, sequence number, Python stack) in a ring
buffer sized by ``TORCH_FR_BUFFER_SIZE``, read when the group is created. On NCCL, torch's watchdog
writes every rank's buffer when a collective times out. Gloo has no watchdog, so for gloo jobs this
module adds one: a collective that exceeds the timeout raises on the rank that waits; that rank asks
all ranks, through the job's key-value store, to write their buffers (a thread on each rank answers
even while its main thread is blocked inside a collective), waits for them, and lets the job fail.

The files (``rank_<N>``, one per rank) are what torch's analyzer reads; it names the first
collective that not every rank joined and the missing ranks::

    torchfrtrace OUTPUT/comm_traces -p rank_
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from pathlib import Path
from types import TracebackType

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from titanium.config.sections import CommSection
from titanium.errors import UserError

logger = logging.getLogger(__name__)

TRACE_PREFIX = "rank_"
_REQUEST_KEY = "titanium/flight_recorder/dump_request"
_DONE_KEY = "titanium/flight_recorder/dumped"
POLL_SECONDS = 1.0
"""How often each rank's watchdog looks for a dump request."""
WAIT_FOR_PEERS_SECONDS = 30.0
"""How long the failing rank waits for the other ranks' traces before it lets the job die."""


class FlightRecorder:
    """Context manager around everything that talks to the process group (set-up and training).

    Entering sets the Flight Recorder environment (so it must happen before ``init_process_group``);
    on gloo it also starts the watchdog thread, which waits for the process group to exist. Leaving
    with an exception that is not a user error writes every rank's trace.
    """

    def __init__(self, comm: CommSection, dump_folder: str | Path) -> None:
        self.enabled = comm.trace_buf_size > 0
        self.buffer_size = comm.trace_buf_size
        self.folder = Path(dump_folder) / comm.save_traces_folder
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._written = False
        self._thread: threading.Thread | None = None

    @property
    def on_gloo(self) -> bool:
        """NCCL writes its own traces on a timeout; the watchdog here is for gloo-only jobs."""
        return not torch.cuda.is_available()

    def __enter__(self) -> FlightRecorder:
        if not self.enabled:
            return self
        self._set_environment()
        if self.on_gloo and int(os.environ.get("WORLD_SIZE", 1)) > 1:
            self._thread = threading.Thread(target=self._watch, name="titanium-flight-recorder", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self._thread is not None and isinstance(exc, Exception) and not isinstance(exc, UserError):
                first_line = str(exc).splitlines()[0] if str(exc) else ""
                self.dump_all_ranks(reason=f"the run failed ({type(exc).__name__}: {first_line})")
        finally:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()

    # ----- environment (before the process group exists) -----

    def _set_environment(self) -> None:
        wanted = {"TORCH_FR_BUFFER_SIZE": str(self.buffer_size)}
        if not self.on_gloo:
            # torch writes <TORCH_FR_DUMP_TEMP_FILE><rank> itself; the folder must exist by then.
            self.folder.mkdir(parents=True, exist_ok=True)
            wanted["TORCH_FR_DUMP_TEMP_FILE"] = str(self.folder / TRACE_PREFIX)
            wanted["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
            # Dumping needs the communicators alive after a timeout (3 = skip clean-up).
            wanted["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "3"
        for key, value in wanted.items():
            current = os.environ.get(key)
            if current is None:
                os.environ[key] = value
            elif current != value:
                logger.warning("Flight Recorder: %s=%s from the environment wins over [comm] (%s)", key, current, value)

    # ----- gloo: writing the traces -----

    def dump_all_ranks(self, reason: str) -> None:
        """Ask every rank to write its trace, write this rank's, and wait (bounded) for the others.

        ``reason`` (the error that ended the run) starts the log line that says where the traces are."""
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        try:
            store = c10d._get_default_store()
            store.set(_REQUEST_KEY, str(dist.get_rank()))
        except Exception as e:  # the store may be gone with the job; still keep this rank's trace
            logger.warning("Flight Recorder: could not ask the other ranks for their traces (%s)", e)
            self.write_trace()
            return
        self._write_and_count(store)
        deadline = time.monotonic() + WAIT_FOR_PEERS_SECONDS
        done = int(store.add(_DONE_KEY, 0))
        while done < world_size and time.monotonic() < deadline:
            time.sleep(0.1)
            done = int(store.add(_DONE_KEY, 0))
        logger.error(
            "%s; Flight Recorder traces of %d of %d ranks are in %s. If a collective hung or timed out, "
            "find it and the ranks that did not join it with: torchfrtrace %s -p %s",
            reason,
            done,
            world_size,
            self.folder,
            self.folder,
            TRACE_PREFIX,
        )

    def write_trace(self) -> Path | None:
        """Write this rank's buffer, with the process-group table the analyzer needs (gloo leaves it
        empty), as ``<folder>/rank_<N>``; None if torch has no Flight Recorder dump."""
        dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
        if dump is None:
            logger.warning("Flight Recorder: this torch cannot dump gloo traces (no _dump_fr_trace)")
            return None
        trace = pickle.loads(dump())
        trace["pg_config"] = {
            name: {"name": name, "desc": group.group_desc, "ranks": str(dist.get_process_group_ranks(group))}
            for group, name in c10d._world.pg_names.items()
        }
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{TRACE_PREFIX}{dist.get_rank()}"
        partial = path.with_name(path.name + ".partial")  # the analyzer must never read half a file
        partial.write_bytes(pickle.dumps(trace))
        partial.replace(path)
        return path

    def _write_and_count(self, store: dist.Store) -> None:
        with self._lock:  # the main thread and the watchdog may both get here
            if self._written:
                return
            self._written = True
            path = self.write_trace()
            store.add(_DONE_KEY, 1)
        logger.warning("Flight Recorder: wrote %s", path)

    def _watch(self) -> None:
        """Watchdog thread: answer the first dump request; runs while the main thread may be blocked."""
        while not self._stop.wait(POLL_SECONDS):
            if not dist.is_initialized():
                continue
            try:
                store = c10d._get_default_store()
                if store.check([_REQUEST_KEY]):
                    self._write_and_count(store)
                    return
            except Exception as e:  # a store that went away with the job: nothing left to answer
                logger.warning("Flight Recorder watchdog stopped: %s", e)
                return
