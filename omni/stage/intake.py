"""What a stage worker does with each message a frontend sends: the token Hello, AddRequest (taken into
the engine, or refused while draining, stopping or asleep), Abort, Release, FreeTensors and Utility.
Apart from worker.py, which owns the sockets, the loop and the output path; these read and change the
worker's state as its loop thread, the only one that calls them."""

from __future__ import annotations

import hmac
import time
from typing import Any

from omni import latency_trace
from omni.engines.base import EngineError
from omni.stage import messages as m
from omni.stage.worker_state import InFlight, engine_request
from omni.transport.base import TransportError


def handle(w: Any, ident: bytes, msg: Any) -> None:
    if isinstance(msg, m.Hello):
        ok = not w.token or hmac.compare_digest(msg.token.encode(), w.token.encode())
        if ok:
            w._frontends.add(ident)
        else:
            w._bad_frames.warning("%s: refused frontend %s: bad token", w.stage.label, msg.frontend_id[:64])
        w._send(ident, m.Welcome(w.stage.stage_id, w.replica_id, ok=ok,
                                 error="" if ok else "bad data-plane token"))
        return
    if w.token and ident not in w._frontends:
        return   # unauthenticated peer: ignore everything
    if isinstance(msg, m.AddRequest):
        add(w, ident, msg)
    elif isinstance(msg, m.Abort):
        for rid in msg.request_ids:
            w._reads.abort(rid)   # pieces still waiting for a read are never admitted
            if w._reqs.pop(rid, None) is not None:
                w.engine.abort(rid)
            if not msg.keep_published:   # kept: freed by FreeTensors as a finished request's are
                w._free_owner(rid)     # a request done here may still own tensors the frontend got
    elif isinstance(msg, m.Release):
        w._holds.release(msg.request_ids)   # also one before its hold began (holds.py)
    elif isinstance(msg, m.FreeTensors):
        if w._producers.free_sent(msg.transport, msg.keys, msg.incarnation):
            w._published.freed(msg.transport, msg.keys)
    elif isinstance(msg, m.Utility):
        utility(w, ident, msg)


def add(w: Any, ident: bytes, msg: m.AddRequest) -> None:
    rid = msg.request_id
    if w._recent.ended(rid):   # crossed its stream's end here on the way: nothing takes it (worker_state)
        return
    if refused(w, ident, rid, rid not in w._reqs and rid not in w._recent and not w._reads.waits(rid)):
        return
    if not w._reads.take(ident, msg):   # else admitted once its (or an earlier piece's) read ends
        admit(w, ident, msg)


def refused(w: Any, ident: bytes, rid: str, new: bool) -> bool:
    """Draining or stopping refuses new work only; asleep, the engine can serve nothing (it
    refused to sleep with work open, or dropped it)."""
    if w.engine.is_sleeping() or ((w.draining or w._stopping.is_set()) and new):
        # The frontend's answer is 503: the stage is there, just not taking requests (how to undo it).
        how = ("asleep; `omni wakeup --stage {s}` or POST /v1/omni/wakeup wakes it" if w.engine.is_sleeping()
               else "draining; `omni undrain --replica {r}` takes it back" if w.draining else "stopping")
        w._send(ident, w._error(rid, f"{w.stage.label} (replica {w.replica_id}) is "
                                     + how.format(s=w.stage.stage_id, r=w.replica_id), "unavailable"))
        return True
    return False


def admit(w: Any, ident: bytes, msg: m.AddRequest, read: Any = None) -> None:
    """Into the engine; `read`: its remote tensors (or their read's error) from InputReads."""
    rid = msg.request_id
    try:
        w.engine.add_request(engine_request(msg, w._consumer, w.stats, read))
        if latency_trace.on():
            latency_trace.mark("added", rid)
    except (EngineError, TransportError, ValueError, TypeError) as e:
        w.stats.errors_total += 1
        kind = "internal" if isinstance(e, TransportError) else "client"   # the engine refused it
        w._send(ident, w._error(rid, f"{type(e).__name__}: {e}", kind))
        return
    except Exception as e:   # the engine broke, not the request (e.g. its vLLM EngineCore died)
        why = f"engine add_request failed: {type(e).__name__}: {e}"
        # unavailable: the frontend moves it to another replica (this one never began it)
        kind = "unavailable" if getattr(e, "fatal", False) else "internal"
        if rid in w._reqs:   # a stream's later piece
            w.engine.abort(rid)
            w._fail(rid, why, kind)
        else:
            w.stats.errors_total += 1
            w._send(ident, w._error(rid, why, kind))
        w._engine_failed(e, "add_request", fail_all=False)
        return
    w._recent.add(rid)
    if rid in w._reqs:
        w._reqs[rid].touched_at = time.monotonic()   # a stream's next piece
    else:
        w.stats.requests_total += 1
        w._reqs[rid] = InFlight(ident, time.monotonic(), msg.out_transport or w.default_transport,
                                msg.out_tensors, hold_s=msg.hold_ms / 1000, out_devices=msg.out_devices)


def utility(w: Any, ident: bytes, msg: m.Utility) -> None:
    try:
        result = w.control.call(msg.method, msg.args)
        w._send(ident, m.UtilityResult(msg.call_id, True, result))
    except Exception as e:
        w._send(ident, m.UtilityResult(msg.call_id, False, None, f"{type(e).__name__}: {e}"))
