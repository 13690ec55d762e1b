"""What a stage worker lets go of when no frontend says so, once the pipeline's request_timeout_s (the
frontend's own bound on every request) has passed: the tensors of requests done here that no frontend
freed (published.py), and requests open here that nothing touched, no input and no output, for that long.

A frontend on ZMQ that goes away is seen only when a send to it fails (a local channel's EOF is seen
at once), and a stream that waits for its next piece (a code2wav for codes, a talker for its thinker)
sends nothing: without the bound it stayed open for the replica's life, counted in flight, and kept a
vocoder from sleeping. Past it, its frontend has ended the request itself."""

from __future__ import annotations

import logging
import time
from typing import Any

from omni.stage import held
from omni.transport.sweep import Sweep

logger = logging.getLogger(__name__)

SWEEP_S = 1.0   # how often `idle` looks


class IdleRequests:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._sweep = Sweep(SWEEP_S)

    def idle(self, reqs: dict[str, Any], held: Any) -> list[str]:
        """Requests (`InFlight`) untouched `ttl_s`; output waiting for consumers counts as a touch
        (the stall timeout bounds it). Looks once a SWEEP_S (else [])."""
        if not reqs or not self._sweep.due():
            return []
        cutoff = time.monotonic() - self.ttl_s
        out = [rid for rid, r in reqs.items() if r.touched_at < cutoff]
        if out and held:
            waiting = {h.rid for h in held}
            out = [rid for rid in out if rid not in waiting]
        return out


def sweep(w: Any) -> None:
    """A StageWorker's expiries (its loop thread, each turn), and the errors owed to dropped frontends."""
    held.pay_due(w)
    stale = w._published.stale(w._reqs)
    if stale:
        logger.warning("%s: freed the tensors of %d request(s) done here that no frontend freed within %.0f s "
                       "(request_timeout_s; a frontend on ZMQ gone unseen?): %s", w.stage.label, len(stale),
                       w._published.ttl_s, _some(stale))
        for rid in stale:
            w._free_owner(rid)
    idle = w._idle.idle(w._reqs, w._held)
    if idle:
        logger.warning("%s: dropped %d request(s) with no input and no output for %g s (request_timeout_s; "
                       "a frontend on ZMQ gone unseen?): %s", w.stage.label, len(idle), w._idle.ttl_s, _some(idle))
        for rid in idle:
            if rid not in w._reqs:
                continue   # the error to an earlier one found its frontend gone: its requests went with it
            w.engine.abort(rid)
            w._fail(rid, f"{w.stage.label}: no input and no output for {w._idle.ttl_s:g} s (request_timeout_s)",
                    "timeout")


def _some(rids: list[str]) -> str:
    return ", ".join(rids[:5]) + (", ..." if len(rids) > 5 else "")
