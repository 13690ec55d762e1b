"""When to restart a frontend that died: at once the first time, later each time it dies soon again.

A frontend that crashes on start (a bad flag in its environment, a port it cannot use) would otherwise be
restarted every supervision tick forever, flooding the log. The delay doubles from `first_s` up to `cap_s`
and is back at `first_s` once a run lasted `reset_after_s`.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class RestartBackoff:
    def __init__(self, first_s: float = 0.5, cap_s: float = 30.0, reset_after_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.first_s, self.cap_s, self.reset_after_s, self.clock = first_s, cap_s, reset_after_s, clock
        self.delay_s = 0.0
        self.started_at: float | None = None
        self.restart_at: float | None = None   # set while a dead child waits for its restart

    def started(self) -> None:
        self.started_at, self.restart_at = self.clock(), None

    def died(self) -> float:
        """Schedule the restart; the delay until it."""
        now = self.clock()
        ran_s = now - self.started_at if self.started_at is not None else 0.0
        if self.delay_s == 0.0 or ran_s >= self.reset_after_s:
            self.delay_s = self.first_s
        else:
            self.delay_s = min(self.cap_s, self.delay_s * 2)
        self.restart_at = now + self.delay_s
        return self.delay_s

    def waiting(self) -> bool:
        return self.restart_at is not None

    def due(self) -> bool:
        return self.restart_at is not None and self.clock() >= self.restart_at
