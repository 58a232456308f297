"""Run an iterator in a background thread, a bounded number of items ahead of its consumer.

Reading, tokenizing and packing are Python work that would otherwise stall the training loop once per
microbatch; in a thread they overlap the model's kernels (which release the GIL). A thread rather than a
worker process keeps the dataset object (and its position) in the training process.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

_POLL_S = 0.1  # how often a producer blocked on a full queue checks whether it was closed
_EXIT_JOIN_S = 10.0  # at interpreter exit, how long to wait for the producer to finish its item


class Prefetcher(Generic[T]):
    """Items of ``make_items()``, produced up to ``depth`` ahead in a daemon thread.

    The producer's exception (a DataError for a bad row, say) is raised in the consumer at the item where
    it happened, and again on any later call.
    """

    def __init__(self, make_items: Callable[[], Iterator[T]], depth: int) -> None:
        assert depth >= 1, depth
        self._queue: queue.Queue[tuple[str, object]] = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._final: BaseException | None = None  # the StopIteration or error every later get() raises
        self._thread = threading.Thread(target=self._produce, args=(make_items,), daemon=True, name="titanium-data")
        self._thread.start()
        # Stop the thread at interpreter exit too: a daemon thread still reading or logging while the
        # interpreter shuts down can take it down with it.
        self._at_exit = weakref.finalize(self, _stop, self._closed, self._thread, _EXIT_JOIN_S)

    def _produce(self, make_items: Callable[[], Iterator[T]]) -> None:
        try:
            for item in make_items():
                if not self._put(("item", item)):
                    return
            self._put(("end", None))
        except BaseException as e:  # handed to the consumer, which raises it
            self._put(("error", e))

    def _put(self, message: tuple[str, object]) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(message, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def get(self) -> T:
        """The next item; StopIteration when the iterator is done."""
        if self._final is not None:
            raise self._final
        kind, value = self._queue.get()
        if kind == "item":
            return value  # type: ignore[return-value]
        self._final = StopIteration() if kind == "end" else value  # type: ignore[assignment]
        raise self._final

    def close(self) -> None:
        """Stop the producer (it finishes the item in hand) and wait for it."""
        self._at_exit.detach()
        _stop(self._closed, self._thread, None)


def _stop(closed: threading.Event, thread: threading.Thread, timeout: float | None) -> None:
    closed.set()
    thread.join(timeout)
