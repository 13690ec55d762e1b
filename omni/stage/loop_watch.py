"""Whether a stage's loop gets anywhere (`pipeline.loop_stall_s`).

A stage's heartbeats come from its keep-alive thread, which goes on while the loop is stuck (an engine
step that never returns, a vLLM EngineCore alive but hung): the replica stayed READY, frontends kept
sending it requests, and those it held waited for request_timeout_s. The keep-alive withholds heartbeats
while `wedged()` says why, so the master's lease expires (DEAD) and the frontends move the requests that
made no output yet; a loop that gets going again heartbeats again (the client registers anew).

The loop thread stamps it: an iteration with nothing to step (or with output held back by its consumers:
stall_timeout_s bounds that) is waiting, never a stall; with work, progress is a step of an engine that computes
in this process returning or marking progress from inside (Engine.progressed: a diffusion engine after each
model block), or a step of one that computes elsewhere (vLLM: its step returns at once) giving output."""

from __future__ import annotations

import time
from typing import Callable


class LoopWatch:
    def __init__(self, stall_s: float, label: str, clock: Callable[[], float] = time.monotonic):
        self.stall_s, self.label, self._clock = stall_s, label, clock
        self._at = clock()
        self._waiting = True   # nothing to do: an idle poll (up to 1 s) is no stall

    def waiting(self) -> None:
        """Loop thread: nothing to step, or output held by its consumers (stall_timeout_s bounds that)."""
        self._at, self._waiting = self._clock(), True

    def stepping(self) -> None:
        """Loop thread, before an engine step: work counts from the first one after a wait."""
        if self._waiting:
            self._at, self._waiting = self._clock(), False

    def progressed(self) -> None:
        """Loop thread: the engine got somewhere."""
        self._at = self._clock()

    def wedged(self) -> str | None:
        """Why the loop is stuck (any thread), or None; never with stall_s 0."""
        if not self.stall_s or self._waiting:   # read before _at: stepping() writes _at first
            return None
        idle = self._clock() - self._at
        if idle <= self.stall_s:
            return None
        return (f"{self.label}: its loop has had work and got nowhere for {idle:.0f} s (a hung engine step; "
                f"pipeline.loop_stall_s {self.stall_s:g} s)")
