"""Tool calls run in worker processes with a time and a memory limit, never in the training process.

A ``ToolSandbox`` keeps ``workers`` processes (``titanium.rl.tools.worker``), each with every tool loaded, and runs
each call in an idle one. Whatever a call does, the caller gets a ``ToolResult``: the tool's text (``ok``), or an
error message for the model (``error``: a malformed call, an unknown tool, a tool that raised, returned something
that is not text or more than ``output_chars`` characters, ran out of memory or took its process down) or
(``timeout``) a call that ran past ``timeout`` seconds, whose process is killed and replaced. Nothing a tool does
stops the run. This bounds resources; it is not a security boundary (the tools run with the job's permissions).
"""

from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Literal

from titanium.rl.tools.parsers import ToolCall

Outcome = Literal["ok", "error", "timeout", "skipped"]
"""A call's fate: ran (ok), failed (error, timeout), or was not run (skipped: a turn at the turn cap)."""
START_TIMEOUT_S = 120.0
"""How long a worker may take to import the tools."""


@dataclass(frozen=True)
class ToolResult:
    name: str
    content: str
    """The text the model reads: the tool's result, or the error message."""
    outcome: Outcome


def error_text(message: str) -> str:
    """An error as the model reads it."""
    return json.dumps({"error": message})


class _Worker:
    """One worker process (started at its first call, again after it was killed or died)."""

    def __init__(self, config: str) -> None:
        self.config = config
        self.process: subprocess.Popen | None = None
        self.buffer = b""

    def start(self) -> str | None:
        """Start the process; the reason it cannot serve, or None."""
        self.process = subprocess.Popen(
            [sys.executable, "-m", "titanium.rl.tools.worker", self.config],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self.buffer = b""
        reply = self._reply(time.monotonic() + START_TIMEOUT_S)
        if reply is None or not reply.get("ready"):
            self.stop()
            return reply.get("error", "no answer") if reply else "it did not start in time"
        return None

    def call(self, name: str, arguments: dict[str, Any], timeout: float) -> tuple[Outcome, str]:
        if self.process is None:
            problem = self.start()
            if problem is not None:
                return "error", f"the tool process could not start: {problem}"
        assert self.process is not None and self.process.stdin is not None
        try:
            self.process.stdin.write((json.dumps({"name": name, "arguments": arguments}) + "\n").encode())
            self.process.stdin.flush()
            reply = self._reply(time.monotonic() + timeout)
        except (BrokenPipeError, EOFError):
            code = self.stop()
            return "error", f"the tool {name!r} took its process down (exit code {code})"
        if reply is None:
            self.stop()
            return "timeout", f"the tool {name!r} timed out after {timeout:g} s"
        if "error" in reply:
            return "error", reply["error"]
        return "ok", reply["content"]

    def _reply(self, deadline: float) -> dict[str, Any] | None:
        """The next JSON line from the process, or None past ``deadline``; EOFError if it exited."""
        assert self.process is not None and self.process.stdout is not None
        fd = self.process.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise EOFError
                self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def stop(self) -> int | None:
        """Kill the process (if any); its exit code."""
        process, self.process = self.process, None
        if process is None:
            return None
        process.kill()
        code = process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()
        return code


class ToolSandbox:
    """Runs calls to ``tools`` (name -> reference ``"module:function"`` or ``"file.py:function"``) in ``workers``
    processes, one call per process at a time; ``call`` is safe from several threads."""

    def __init__(
        self, tools: dict[str, str], timeout: float, memory_mb: int, output_chars: int, workers: int = 1
    ) -> None:
        self.names, self.timeout = sorted(tools), timeout
        config = json.dumps({"tools": tools, "memory_mb": memory_mb, "output_chars": output_chars})
        self._workers = [_Worker(config) for _ in range(max(1, workers))]
        self._idle: queue.Queue[_Worker] = queue.Queue()
        for worker in self._workers:
            self._idle.put(worker)

    def call(self, call: ToolCall) -> ToolResult:
        if call.error is not None:
            return ToolResult(call.name, error_text(call.error), "error")
        if call.name not in self.names:
            known = ", ".join(self.names) or "none"
            return ToolResult(call.name, error_text(f"unknown tool {call.name!r}; the tools are: {known}"), "error")
        worker = self._idle.get()
        try:
            outcome, text = worker.call(call.name, call.arguments, self.timeout)
        finally:
            self._idle.put(worker)
        return ToolResult(call.name, text if outcome == "ok" else error_text(text), outcome)

    def close(self) -> None:
        for worker in self._workers:
            worker.stop()
