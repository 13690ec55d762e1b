"""Producers another host's reads timed out on, held as down for a while.

A read from a host that went silent (powered off, cut off) waits for the transport's timeout
(30 s). Without this every later read of that producer waited the same 30 s, each on one of the
frontend's few read threads (omni/orchestrator/fetch.py), stalling the reads of live hosts
behind them; now only the reads already in flight wait, and later ones fail at once (the request
fails or is replayed) until DOWN_S has passed, when one read tries again (a success, of that read
or any other, lifts the hold). A refused connection is not held: it fails at once anyway.
"""

from __future__ import annotations

import threading
import time

from omni.transport.base import TransportError

DOWN_S = 10.0


class DownProducers:
    def __init__(self, hold_s: float = DOWN_S, clock=time.monotonic):
        self._hold_s = hold_s
        self._clock = clock
        self._lock = threading.Lock()
        self._down: dict[str, tuple[float, str]] = {}    # endpoint -> (when, why)

    def check(self, endpoint: str) -> None:
        """TransportError if `endpoint` timed out less than hold_s ago."""
        with self._lock:
            entry = self._down.get(endpoint)
            if entry is None:
                return
            now = self._clock()
            ago = now - entry[0]
            if ago >= self._hold_s:          # this read probes; the others still fail at once until it ends
                self._down[endpoint] = (now, entry[1])
                return
        raise TransportError(f"producer {endpoint} is not answering ({entry[1]} {ago:.1f} s ago); "
                             f"not tried again for {self._hold_s - ago:.1f} s")

    def mark(self, endpoint: str, why: str) -> None:
        with self._lock:
            self._down[endpoint] = (self._clock(), why)

    def clear(self, endpoint: str) -> None:
        with self._lock:
            self._down.pop(endpoint, None)
