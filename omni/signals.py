"""A stop request that a signal handler may set without taking a lock.

A Python signal handler runs on the main thread between two bytecodes, possibly while that
thread holds a lock (a threading.Event's condition, a socket lock). A handler that takes the
same lock again waits for itself forever: a stage process hung that way when SIGTERM came
twice. Here the handler only sets a flag and writes a byte to a pipe; waiters select on it.
"""

from __future__ import annotations

import os
import select
import signal


class StopRequest:
    def __init__(self) -> None:
        self.requested = False
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def set(self, *_signal_args) -> None:
        """Usable as a signal handler."""
        self.requested = True
        try:
            os.write(self._w, b"\0")
        except OSError:
            pass   # the pipe is full: it is readable already

    def is_set(self) -> bool:
        return self.requested

    def wait(self, timeout: float | None = None) -> bool:
        """True once a stop was requested; waits up to `timeout` seconds (None: for good)."""
        if not self.requested:
            try:
                select.select([self._r], [], [], timeout)
            except InterruptedError:
                pass
        return self.requested

    def fileno(self) -> int:
        """Readable once a stop was requested (for pollers)."""
        return self._r

    def install(self, signals=(signal.SIGINT, signal.SIGTERM)) -> "StopRequest":
        for sig in signals:
            signal.signal(sig, self.set)
        return self
