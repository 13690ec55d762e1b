"""Whether a stage's keep-alive reaches its master, said in its log: one WARNING when the master becomes
unreachable and one WARNING when it is back (an INFO would not show at a stage's default --log-level, which
showed the outage and never its end), so a headless stage whose head was stopped does not wait in silence
(the stream's own errors are DEBUG: they come every backoff, up to 1.5 s apart)."""

from __future__ import annotations

import logging
import threading
import time

from omni.ratelog import RateLimitedLog


class Reachability:
    """lost() on a failed keep-alive stream, back() once a heartbeat went out or the stage registered again.
    A master that flaps logs at most `burst` outages a minute; its return is logged only for a WARNING that was."""

    def __init__(self, address: str, logger: logging.Logger, retry_s: float, burst: int = 5):
        self.address = address
        self._log = logger
        self._warn = RateLimitedLog(logger, burst=burst, period_s=60.0)
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._since: float | None = None   # monotonic time the master was first unreachable
        self._said = False                 # whether that outage's WARNING was logged

    @property
    def unreachable(self) -> bool:
        return self._since is not None

    def lost(self, why: str) -> None:
        with self._lock:
            if self._since is not None:
                return
            self._since = time.monotonic()
        self._said = self._warn.warning("omni master %s unreachable (%s), retrying every %g s until it is back",
                                        self.address, why, self._retry_s)

    def back(self) -> None:
        with self._lock:
            since, self._since = self._since, None
        if since is not None and self._said:
            self._log.warning("omni master %s reachable again after %.1f s", self.address, time.monotonic() - since)
