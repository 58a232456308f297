"""The generation thread's own CUDA stream, and the hand-overs that keep it safe for the caching allocator.

On CUDA, kernels the generation thread launched on the default stream queued behind the training step's, so the
GPU ran them one after the other and only the launches overlapped. On a stream of its own they run beside the
loop's. Three hand-overs make that correct whatever the job does:

1. Inputs. A job may read what the loop's stream wrote before the job was submitted (the engine's weights after a
   sync; any tensor it is given): ``bind`` records an event on the loop's stream, in the loop's thread, and the
   side stream waits for it before the job's first kernel.
2. Outputs. The job's last kernels are done before its result is handed over: the thread waits for the side stream
   (only the thread blocks), so the loop may read the result on any stream once the future is done. Memory is the
   subtle part: the caching allocator reuses a freed block on the stream that allocated it, so a tensor the job
   made, freed by the loop while the loop's stream still reads it, could be handed to the next job's allocations
   (already running on the side stream) too early. Every tensor of the result on the engine's device is marked as
   used by the loop's stream (``record_stream``): its block is not reused before the loop's work queued up to the
   free is done. A result keeps its tensors in dataclasses, mappings, lists and tuples (``device_tensors`` looks
   there and nowhere else).
3. The weight sync. It waits for the job first (``GenerationWorker.wait``), and by 2 the job's kernels are done by
   then: the sync's copies never overwrite weights the side stream still reads.

The stream has a high priority: decoding is a chain of short kernels on the critical path, and the training step's
large kernels fill the GPU around them. Off CUDA (or with no device) there is no stream and a job is the call
itself, so the CPU path is the thread alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

T = TypeVar("T")
SCALARS = frozenset({int, float, bool, str, bytes, type(None)})
HIGH_PRIORITY = -1  # (torch.cuda.Stream: lower is higher; clamped to the device's range)


class SideStream:
    """The stream generation jobs run on (CUDA only), and ``bind``, which wraps a job in the hand-overs."""

    def __init__(self, device: torch.device | None) -> None:
        self.stream: torch.cuda.Stream | None = None
        if device is not None and device.type == "cuda":
            self.stream = torch.cuda.Stream(device, priority=HIGH_PRIORITY)

    def bind(self, call: Callable[[], T]) -> Callable[[], T]:
        """``call`` as a job for the generation thread; to be called in the loop's thread when the job is handed
        over (the loop's current stream then is the one its inputs come from and its result goes to)."""
        stream = self.stream
        if stream is None:
            return call
        loop = torch.cuda.current_stream(stream.device)
        inputs_ready = loop.record_event()

        def job() -> T:
            stream.wait_event(inputs_ready)
            try:
                with torch.cuda.stream(stream):
                    result = call()
            finally:  # (also after a failure: the sync that follows must not overwrite weights still read)
                stream.synchronize()
            for tensor in device_tensors(result, stream.device):
                tensor.record_stream(loop)
            return result

        return job


def device_tensors(obj: Any, device: torch.device) -> list[torch.Tensor]:
    """Every tensor on ``device`` that ``obj`` holds, in dataclass fields, mapping values, list and tuple items."""
    found, pending = [], [obj]
    while pending:
        item = pending.pop()
        if type(item) in SCALARS:  # (the bulk of a result: token ids, texts; skipped first)
            continue
        if isinstance(item, torch.Tensor):
            if item.device == device:
                found.append(item)
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
        elif isinstance(item, Mapping):
            pending.extend(item.values())
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            pending.extend(getattr(item, f.name) for f in dataclasses.fields(item))
    return found
