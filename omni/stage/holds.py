"""A stage's first-output holds (AddRequest.hold_ms, the stage's `first_output_hold_ms`): after its first
output the engine steps no more of a request until the frontend's Release, or until hold_ms is up.

A Release can come before the hold begins: on the same channel before the request is admitted (an
AddRequest whose remote tensors are read off the loop, input_reads.py, is admitted after what came later)
or while the request has no output yet (a talker's next sentence when the first audio is out). The engine
ignores a release of an id it does not hold, so the id is remembered here and its hold never begins;
forgotten when the request ends, and bounded for the ids of requests that never come."""

from __future__ import annotations

import math
import time
from collections import OrderedDict

from omni.engines.base import Engine


class Holds:
    def __init__(self, engine: Engine, cap: int = 4096):
        self._engine = engine
        self.cap = cap
        self._released: OrderedDict[str, None] = OrderedDict()

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._engine.release(rid)
            self._released[rid] = None
            if len(self._released) > self.cap:
                self._released.popitem(last=False)

    def begin(self, rid: str, hold_s: float) -> None:
        """At the request's first output (not its last)."""
        if hold_s and rid not in self._released:
            self._engine.hold(rid, time.monotonic() + hold_s)

    def end(self, rid: str) -> None:
        self._released.pop(rid, None)

    def idle_ms(self) -> int:
        """The loop's wait with nothing to step: 1 s, or until a hold ends."""
        until = self._engine.held_until()
        return 1000 if until is None else min(1000, max(0, math.ceil((until - time.monotonic()) * 1000)))
