"""Rate-limited warnings for things a peer can trigger at will (bad frames, refused hellos):
a stranger must not be able to fill the disk or hold a core with log lines."""

from __future__ import annotations

import logging
import threading
import time


class RateLimitedLog:
    """At most `burst` lines per `period_s` per limiter; the next line that gets through
    says how many were dropped meanwhile."""

    def __init__(self, logger: logging.Logger, burst: int = 5, period_s: float = 60.0):
        self._logger = logger
        self._burst = burst
        self._period = period_s
        self._lock = threading.Lock()
        self._window = -period_s
        self._count = 0
        self.dropped = 0

    def warning(self, msg: str, *args: object) -> bool:
        """Whether the line was logged (False: dropped by the limit)."""
        now = time.monotonic()
        with self._lock:
            if now - self._window >= self._period:
                self._window, self._count = now, 0
            if self._count >= self._burst:
                self.dropped += 1
                return False
            self._count += 1
            dropped, self.dropped = self.dropped, 0
        if dropped:
            msg += f" ({dropped} similar line(s) dropped)"
        self._logger.warning(msg, *args)
        return True
