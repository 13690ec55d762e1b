"""A stage worker's held output (backpressure): what could not go out yet waits, in order, and the engine
is not stepped meanwhile. Two kinds wait: output whose tensors do not fit the producer (its consumers must
free some), timed from when it was made; and frames to a frontend whose queue is full, timed from the
frontend's first refused send until it takes one. Past `stall_timeout_s` the first fails its request; the
second means that frontend reads nothing: it is dropped whole (its requests, held frames and tensors), so
one frontend that stopped reading holds the stage for one stall_timeout_s, however many of its requests
wait, and queues no error frame it would not read either. A ZMQ frontend stays admitted, so one that was
only paused (SIGSTOP, a long GC, swap) may read again: its dropped requests are owed an error frame each
(`Owed`), sent once it takes a frame, rather than leaving their clients to wait request_timeout_s."""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable

from omni.stage.worker_state import HeldOutput
from omni.transport.sweep import Sweep

logger = logging.getLogger(__name__)

RETRY_S = 1.0   # how often a dropped frontend's owed errors are tried when nothing else goes to it
OWED_FRONTENDS, OWED_REQUESTS = 64, 1024


def send(w: Any, ident: bytes, frame: bytes) -> bool:
    """One frame to a frontend; False when its queue is full (the time of the first refusal is kept)."""
    if w._send_frame(ident, frame):
        if w._full_since:
            w._full_since.pop(ident, None)
        if ident in w._owed:
            pay(w, ident)
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
                ident = h.ident
                local = w._local is not None and w._local.link(ident) is not None   # closed: never read again
                rids = [] if local else [r for r, q in w._reqs.items() if q.frontend == ident] + [
                    x.rid for x in w._held if x.ident == ident and x.rid and x.rid not in w._reqs]
                w._frontend_gone(ident, f"it read nothing for {w.stall_timeout_s:g} s (stall_timeout_s)")
                w._owed.add(ident, rids)
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


class Owed:
    """Requests dropped with their ZMQ frontend (it read nothing for stall_timeout_s), each owed one error
    frame. Bounded: OWED_FRONTENDS frontends (the oldest forgotten) of OWED_REQUESTS each, and kept for
    `ttl_s` (request_timeout_s: by then the frontend has ended them itself)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._owed: dict[bytes, tuple[float, dict[str, None]]] = {}
        self._sweep = Sweep(RETRY_S)

    def __contains__(self, ident: bytes) -> bool:
        return ident in self._owed

    def add(self, ident: bytes, rids: list[str]) -> None:
        if not rids:
            return
        _, owed = self._owed.pop(ident, (0.0, {}))
        owed.update(dict.fromkeys(rids[:OWED_REQUESTS - len(owed)]))
        self._owed[ident] = (time.monotonic(), owed)
        while len(self._owed) > OWED_FRONTENDS:
            self._owed.pop(next(iter(self._owed)))

    def forget(self, ident: bytes) -> None:
        self._owed.pop(ident, None)

    def due(self) -> list[bytes]:
        """The frontends to try now (at most once a RETRY_S); those owed past ttl_s are forgotten."""
        if not self._owed or not self._sweep.due():
            return []
        cutoff = time.monotonic() - self.ttl_s
        for ident in [i for i, (at, _) in self._owed.items() if at < cutoff]:
            del self._owed[ident]
        return list(self._owed)

    def pay(self, ident: bytes, send: Callable[[str], bool]) -> None:
        """send(rid) each owed error until one finds the queue full (the rest wait for the next try).
        A send that finds the frontend gone forgets it (`forget`, from the worker's _frontend_gone)."""
        while ident in self._owed:
            owed = self._owed[ident][1]
            if not owed:
                del self._owed[ident]
                return
            rid = next(iter(owed))
            if not send(rid):
                return
            owed.pop(rid, None)


def pay(w: Any, ident: bytes) -> None:
    """Send a frontend dropped for reading nothing the error frames it is owed, as far as it takes them."""
    why = f"{w.stage.label}: dropped: this frontend read nothing for {w.stall_timeout_s:g} s (stall_timeout_s)"
    w._owed.pay(ident, lambda rid: w._send_frame(ident, w._out.encode(w._error(rid, why, "timeout"))))


def pay_due(w: Any) -> None:
    """Each loop turn: the owed frontends, once a RETRY_S (one that reads again but sends nothing)."""
    for ident in w._owed.due():
        pay(w, ident)
