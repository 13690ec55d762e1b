"""A stop request that a signal handler may set without taking a lock.

A Python signal handler runs on the main thread between two bytecodes, possibly while that
thread holds a lock (a threading.Event's condition, a socket lock). A handler that takes the
same lock again waits for itself forever: a stage process hung that way when SIGTERM came
twice. Here the handler only sets a flag and writes a byte to a pipe; waiters select on it.

A signal sent to the process may land on any thread (grpc's, zmq's). The C-level handler then
runs there and only marks the signal pending: the Python handler waits for the main thread's
next bytecode, and a main thread blocked in select() for good never gets one (`omni master`
hung so on SIGTERM). So waits are sliced, and pollers of fileno() need a timeout too.
(The process's wakeup fd would wake them at once, but any other handled signal writes to it
as well, which would leave the pipe readable with no stop requested.)
"""

from __future__ import annotations

import os
import select
import signal
import time

_SLICE_S = 0.1   # a wait returns to bytecode this often, so a pending handler runs


class StopRequest:
    def __init__(self) -> None:
        self.requested = False
        self.count = 0   # requests so far: a second one during a graceful stop cuts it short
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def set(self, *_signal_args) -> None:
        """Usable as a signal handler."""
        self.requested = True
        self.count += 1
        try:
            os.write(self._w, b"\0")
        except OSError:
            pass   # the pipe is full: it is readable already

    def is_set(self) -> bool:
        return self.requested

    def wait(self, timeout: float | None = None) -> bool:
        """True once a stop was requested; waits up to `timeout` seconds (None: for good)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.requested:
            left = _SLICE_S if deadline is None else min(_SLICE_S, deadline - time.monotonic())
            if left <= 0:
                break
            try:
                select.select([self._r], [], [], left)
            except InterruptedError:
                pass
        return self.requested

    def fileno(self) -> int:
        """Readable once a stop was requested (for pollers)."""
        return self._r

    def close(self) -> None:
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass

    def install(self, signals=(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)) -> "StopRequest":
        """SIGHUP too: a closed terminal must stop the process as SIGTERM does (its default action ends it
        with no cleanup: temp files holding the stages' env, the run file, children left to PDEATHSIG).
        An inherited SIG_IGN for SIGHUP is kept: that is `nohup`, asking to outlive the terminal."""
        for sig in signals:
            if sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN:
                continue
            signal.signal(sig, self.set)
        return self
