"""A frontend that stops reading (SIGSTOPped, hung, cut off; its connection stays open) holds a stage's
output, so the stage steps nothing for anyone, for one stall_timeout_s at most: then that frontend is
dropped whole and the others' requests go on."""

from __future__ import annotations

import threading
import time

import pytest

from omni.config import StageConfig
from omni.engines.base import SamplingParams
from omni.stage import held, messages as m
from omni.stage.worker import StageWorker
from tests.unit.test_stage_worker import CountEngine

STALL_S = 0.5


def add(w: StageWorker, ident: bytes, rid: str, max_tokens: int) -> None:
    w._handle(ident, m.AddRequest(request_id=rid, prompt_token_ids=[1], sampling=SamplingParams(max_tokens=max_tokens)))


@pytest.mark.parametrize("n_stuck", [2, 8])
def test_a_frontend_that_reads_nothing_holds_the_stage_one_stall_timeout_however_many_requests_it_has(n_stuck):
    """Before: each of its held requests restarted the timer twice (its output made a frame with a fresh
    time, then its error frame, queued to the same full queue, another): 2 x N x stall_timeout_s."""
    engine = CountEngine()
    w = StageWorker(StageConfig(stage_id=0, engine="count", name="thinker"), engine, stall_timeout_s=STALL_S)
    w._frontends |= {b"stuck", b"fe"}
    dec = m.frontend_codec()
    to_stuck: list = []
    healthy_done = threading.Event()

    def send_frame(ident, frame):
        if ident == b"stuck":
            to_stuck.append(dec.decode(frame))
            return False          # its queue is full: it stopped reading
        msg = dec.decode(frame)
        if isinstance(msg, m.Output) and msg.request_id == "healthy" and msg.finished:
            healthy_done.set()
        return True

    w._send_frame = send_frame
    for i in range(n_stuck):
        add(w, b"stuck", f"stuck{i}", 1000)
    add(w, b"fe", "healthy", 3)
    t = threading.Thread(target=w.run, daemon=True)
    t0 = time.monotonic()
    t.start()
    try:
        assert healthy_done.wait(20 * STALL_S), "the healthy request never finished"
        waited = time.monotonic() - t0
        assert waited < 2.5 * STALL_S, f"the healthy request waited {waited:.2f} s"
        assert sorted(engine.aborted) == sorted(f"stuck{i}" for i in range(n_stuck))
        # no error queued where none is read: its owed errors are only tried (once a RETRY_S), never held
        tried = [x for x in to_stuck if isinstance(x, m.RequestError)]
        assert len(tried) <= 1 + waited / held.RETRY_S
    finally:
        w.stop()
        t.join(10)
    assert not t.is_alive() and not w._held and not w._full_since


def test_a_dropped_frontend_that_reads_again_gets_an_error_for_each_dropped_request():
    """Only paused (SIGSTOP, a long GC): once it reads again, each request dropped with it gets one error
    frame, also with nothing else to send it. Before: none ever came, and its clients waited
    request_timeout_s for a timeout."""
    engine = CountEngine()
    w = StageWorker(StageConfig(stage_id=0, engine="count", name="thinker"), engine, stall_timeout_s=STALL_S)
    w._frontends |= {b"stuck"}
    dec = m.frontend_codec()
    reading = threading.Event()
    errors: list[m.RequestError] = []
    all_errors = threading.Event()

    def send_frame(ident, frame):
        if not reading.is_set():
            return False
        msg = dec.decode(frame)
        if isinstance(msg, m.RequestError):
            errors.append(msg)
            if len(errors) >= 3:
                all_errors.set()
        return True

    w._send_frame = send_frame
    for i in range(3):
        add(w, b"stuck", f"stuck{i}", 1000)
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 20 * STALL_S
        while len(engine.aborted) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(engine.aborted) == ["stuck0", "stuck1", "stuck2"], "the frontend was not dropped"
        reading.set()                     # it reads again, and sends nothing
        assert all_errors.wait(10 * STALL_S), f"errors sent: {errors}"
    finally:
        w.stop()
        t.join(10)
    assert not t.is_alive()
    assert sorted(e.request_id for e in errors) == ["stuck0", "stuck1", "stuck2"]    # one each
    assert all("dropped: this frontend read nothing for 0.5 s" in e.message and e.kind == "timeout" for e in errors)
    assert b"stuck" not in w._owed


def test_owed_errors_wait_for_a_full_queue_and_are_bounded():
    owed = held.Owed(ttl_s=300.0)
    owed.add(b"fe", ["a", "b", "c"])
    sent: list[str] = []
    owed.pay(b"fe", lambda rid: False)                  # its queue is still full: kept
    assert b"fe" in owed
    owed.pay(b"fe", lambda rid: sent.append(rid) or rid != "b")   # "b" finds it full again
    assert sent == ["a", "b"] and b"fe" in owed
    owed.pay(b"fe", lambda rid: sent.append(rid) or True)
    assert sent == ["a", "b", "b", "c"] and b"fe" not in owed

    owed.add(b"gone", ["x", "y"])                       # a send that finds it gone forgets it
    owed.pay(b"gone", lambda rid: owed.forget(b"gone") or True)
    assert b"gone" not in owed

    owed.add(b"many", [str(i) for i in range(held.OWED_REQUESTS + 10)])
    for i in range(held.OWED_FRONTENDS):
        owed.add(bytes([i]), ["r"])
    assert b"many" not in owed and len(owed.due()) == held.OWED_FRONTENDS   # the oldest went first

    old = held.Owed(ttl_s=0.0)
    old.add(b"fe", ["a"])
    assert old.due() == [] and b"fe" not in old          # past request_timeout_s its frontend ended them
