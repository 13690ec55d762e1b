"""A frontend that stops reading (SIGSTOPped, hung, cut off; its connection stays open) holds a stage's
output, so the stage steps nothing for anyone, for one stall_timeout_s at most: then that frontend is
dropped whole and the others' requests go on."""

from __future__ import annotations

import threading
import time

import pytest

from omni.config import StageConfig
from omni.engines.base import SamplingParams
from omni.stage import messages as m
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
        assert not any(isinstance(x, m.RequestError) for x in to_stuck)   # no error queued where none is read
    finally:
        w.stop()
        t.join(10)
    assert not t.is_alive() and not w._held and not w._full_since
