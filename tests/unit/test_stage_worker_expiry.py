"""StageWorker: an open request nothing touches for request_timeout_s is dropped (a frontend on ZMQ
gone unseen), one that keeps getting pieces or sending output is not."""

from __future__ import annotations

import threading
import time

from omni.config import StageConfig
from omni.engines.base import EngineError, EngineOutput, StreamEngine
from omni.stage import expiry
from omni.stage import messages as m
from omni.stage.worker import StageWorker
from omni.stage.worker_state import HeldOutput, InFlight
from tests.unit.test_stage_worker import dealer, enc, hello, load_when, recv


class Streams(StreamEngine):
    """code2wav-like: one output per piece, ends at the final piece; refuses sleep with streams open."""

    def __init__(self):
        self.s: dict[str, dict] = {}

    def open_requests(self):
        return self.s.values()

    def is_ready(self, r):
        return r["new"] > 0

    def add_request(self, r):
        st = self.s.setdefault(r.request_id, {"rid": r.request_id, "new": 0, "final": False})
        st["new"] += 1
        st["final"] = r.final

    def abort(self, rid):
        self.s.pop(rid, None)

    def step(self):
        outs = []
        for st in list(self.s.values()):
            if st["new"]:
                st["new"] = 0
                outs.append(EngineOutput(request_id=st["rid"], token_ids=[1], finished=st["final"]))
                if st["final"]:
                    del self.s[st["rid"]]
        return outs

    def can_sleep(self):
        return True

    def sleep(self, level=1):
        if self.s:
            raise EngineError(f"cannot sleep with {len(self.s)} stream(s) open")


def test_idle_lists_requests_untouched_for_the_ttl_not_those_with_output_held(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(expiry.time, "monotonic", lambda: now[0])
    monkeypatch.setattr("omni.transport.sweep.time.monotonic", lambda: now[0])
    idle = expiry.IdleRequests(ttl_s=10.0)
    reqs = {rid: InFlight(b"fe", 100.0, "shm") for rid in ("quiet", "held", "fed")}
    now[0] = 109.0
    reqs["fed"].touched_at = 109.0
    assert idle.idle(reqs, []) == []
    now[0] = 111.0
    assert idle.idle(reqs, [HeldOutput("held", 110.0, b"fe")]) == ["quiet"]
    assert idle.idle(reqs, []) == []             # looks once a SWEEP_S
    now[0] = 120.0
    assert idle.idle(reqs, []) == ["quiet", "held", "fed"]


def test_a_stream_whose_zmq_frontend_went_unseen_is_dropped_after_the_ttl():
    """Before: a stream waiting for its next piece stayed open for the replica's life (in_flight 1,
    and the vocoder refused to sleep); a stream that keeps getting pieces must not be dropped."""
    eng = Streams()
    w = StageWorker(StageConfig(stage_id=2, engine="x", name="code2wav"), eng, token="secret", replica_id="s2r0",
                    published_ttl_s=1.5)
    t = threading.Thread(target=w.run, kwargs={"grace_s": 0.5}, daemon=True)
    t.start()
    live, gone = dealer(w.endpoint, b"fe-live"), dealer(w.endpoint, b"fe-gone")
    try:
        assert hello(live).ok and hello(gone).ok
        gone.send(enc.encode(m.AddRequest(request_id="dead", prompt_token_ids=[1], final=False)))
        assert recv(gone).request_id == "dead"
        gone.close(0)                            # its process died: nothing tells the stage
        start = time.monotonic()
        # pieces 0.3 s apart until the dead one goes (ttl 1.5 s, looked at once a second): never idle for the ttl
        while "dead" in w._reqs and time.monotonic() - start < 6.0:
            live.send(enc.encode(m.AddRequest(request_id="fed", prompt_token_ids=[1], final=False)))
            assert recv(live).request_id == "fed"
            live.poll(300)
        assert time.monotonic() - start > 1.5 and "fed" in eng.s and "fed" in w._reqs
        assert "dead" not in eng.s and "dead" not in w._reqs
        load_when(w, lambda load: load["in_flight"] == 1)
        live.send(enc.encode(m.AddRequest(request_id="fed", prompt_token_ids=[1], final=True)))
        assert recv(live).finished
        ok, msg = w.command("SLEEP", {"level": 1}, timeout=10)
        assert ok, msg
    finally:
        live.close(0)
        w.stop()
        t.join(10)
