"""A stage worker's held output (backpressure): what could not go out yet waits, in order, and the engine
is not stepped meanwhile. Two kinds wait: output whose tensors do not fit the producer (its consumers must
free some), timed from when it was made; and frames to a frontend whose queue is full, timed from the
frontend's first refused send until it takes one. Past `stall_timeout_s` the first fails its request; the
second means that frontend reads nothing: it is dropped whole (its requests, held frames and tensors), so
one frontend that stopped reading holds the stage for one stall_timeout_s, however many of its requests
wait, and queues no error frame it would not read either."""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from omni.stage.worker_state import HeldOutput

logger = logging.getLogger(__name__)


def send(w: Any, ident: bytes, frame: bytes) -> bool:
    """One frame to a frontend; False when its queue is full (the time of the first refusal is kept)."""
    if w._send_frame(ident, frame):
        if w._full_since:
            w._full_since.pop(ident, None)
        return True
    w._full_since.setdefault(ident, time.monotonic())
    return False


def hold(w: Any, held: HeldOutput) -> None:
    if not w._held:
        w._stall_started = time.monotonic()
        w.stats.stalls += 1
        logger.info("%s: output waits for consumers (backpressure)", w.stage.label)
    w._held.append(held)


def flush(w: Any) -> None:
    """Retry held output in order; past the stall timeout, fail the request at the head (tensors that do
    not fit) or drop its frontend (a queue full that long)."""
    w._flushing = True
    try:
        while w._held:
            h = w._held.popleft()
            if h.out is not None:
                if w._publish(h.out, h.step_s):
                    continue      # sent, or its frame now heads the queue
            elif send(w, h.ident, h.frame):
                continue
            w._held.appendleft(h)
            now = time.monotonic()
            if h.out is None:
                if now - w._full_since.get(h.ident, now) <= w.stall_timeout_s:
                    break
                w._frontend_gone(h.ident, f"it read nothing for {w.stall_timeout_s:g} s (stall_timeout_s)")
                continue
            if now - h.since <= w.stall_timeout_s:
                break
            w._held.popleft()
            drop(w, h.rid, f"{w.stage.label}: output waited {w.stall_timeout_s:.0f} s for "
                           f"consumers to free tensors or read results (stall_timeout_s)")
    finally:
        w._flushing = False
    if not w._held and w._stall_started is not None:
        w.stats.stall_s_total += time.monotonic() - w._stall_started
        w._stall_started = None


def drop(w: Any, rid: str, message: str) -> None:
    """Fail a request whose output waited too long (its other held output goes with it)."""
    w._held = deque(h for h in w._held if not rid or h.rid != rid)
    if rid in w._reqs:
        w.engine.abort(rid)
        w._fail(rid, message)
    elif rid:
        w._free_owner(rid)   # done here: its dropped output's tensors reach no one
