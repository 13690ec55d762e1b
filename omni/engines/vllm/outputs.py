"""Waiting for vLLM's EngineCore outputs in the stage process.

vLLM's client (SyncMPClient) has an output thread that reads the EngineCore's socket and
puts each step's outputs on `outputs_queue`; the stage engine is that queue's only reader.
`OutputWaiter` adds an eventfd the output thread bumps with every put, so the stage loop
can sleep on it next to its own sockets (Engine.ready_fd) instead of polling step().
"""

from __future__ import annotations

import os
import queue
from typing import Any


class OutputWaiter:
    def __init__(self, q: queue.Queue):
        self._q = q
        self.fd: int | None = None
        if not hasattr(os, "eventfd"):   # Linux only; without it the worker polls step()
            return
        fd = self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        put = q.put_nowait   # what the output thread calls (vllm/v1/engine/core_client.py)

        def put_nowait(item: Any) -> None:
            put(item)
            os.eventfd_write(fd, 1)

        q.put_nowait = put_nowait

    def wait(self, timeout: float) -> bool:
        """True once the queue holds something (waits at most `timeout`)."""
        if self.fd is not None:
            try:
                os.eventfd_read(self.fd)   # reset before looking: a later put wakes the loop again
            except BlockingIOError:
                pass
        with self._q.not_empty:
            if not self._q.queue:
                self._q.not_empty.wait(timeout)
            return bool(self._q.queue)

    def head_timestamp(self) -> float | None:
        """When the EngineCore made the next outputs (its time.monotonic(): the host's clock)."""
        return getattr(self._q.queue[0], "timestamp", None) if self._q.queue else None

    def rearm(self) -> None:
        """After a step: more was queued than it took, so the loop must wake again."""
        if self.fd is not None and self._q.queue:
            os.eventfd_write(self.fd, 1)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
