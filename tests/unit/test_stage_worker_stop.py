"""StageWorker while it stops or drains: the wait of its loop, and which requests it still takes."""

from __future__ import annotations

import os
import threading

from omni.config import StageConfig
from omni.engines.base import EngineOutput, SamplingParams
from omni.signals import StopRequest
from omni.stage import messages as m
from omni.stage.worker import StageWorker
from tests.unit.test_stage_worker import ReadyFdEngine, dealer, enc, hello, recv, running


class AddedReadyFdEngine(ReadyFdEngine):
    def __init__(self):
        super().__init__()
        self.added = threading.Event()
        self.ids: list[str] = []

    def add_request(self, r) -> None:
        super().add_request(r)
        self.ids.append(r.request_id)
        self.added.set()


def test_a_stop_request_ends_one_wait_of_the_loop_not_every_wait_of_the_grace():
    engine, stop = AddedReadyFdEngine(), StopRequest()
    w = StageWorker(StageConfig(stage_id=0, engine="ready", name="ready"), engine, token="secret",
                    replica_id="s0r0", stop_request=stop)
    polls_with_stop = []
    real_poll = w._poll.poll

    def poll(timeout_ms, spin=True):
        result = real_poll(timeout_ms, spin)
        if stop.fileno() in result[2]:
            polls_with_stop.append(timeout_ms)
        return result
    w._poll.poll = poll
    t = threading.Thread(target=w.run, kwargs={"grace_s": 0.5}, daemon=True)
    t.start()
    try:
        s = dealer(w.endpoint)
        assert hello(s).ok
        s.send(enc.encode(m.AddRequest(request_id="r1", prompt_token_ids=[10], sampling=SamplingParams(max_tokens=2))))
        assert engine.added.wait(10)
        stop.set()
        err = recv(s)   # the engine never answers: the grace runs out and the request fails
        assert isinstance(err, m.RequestError) and "shutting down" in err.message
        s.close()
    finally:
        w.stop()
        t.join(10)
        os.close(stop._r)
        os.close(stop._w)
    assert not t.is_alive()
    # The stop pipe is never read: left in the poller, every poll of the grace returned at once.
    assert len(polls_with_stop) <= 1, len(polls_with_stop)


def test_a_draining_stage_takes_the_later_parts_of_what_it_holds_and_nothing_new():
    gen = running(StageConfig(stage_id=1, engine="ready", name="talker"), AddedReadyFdEngine())
    w, engine = next(gen)
    try:
        s = dealer(w.endpoint)
        assert hello(s).ok

        def add(rid):
            s.send(enc.encode(m.AddRequest(request_id=rid, prompt_token_ids=[1], final=False)))

        def until_ping(call_id):
            s.send(enc.encode(m.Utility(call_id, "ping")))
            got = []
            while not isinstance(msg := recv(s), m.UtilityResult):
                got.append(msg)
            return got

        add("r1")                                   # a stream's first piece
        add("sp/s1")                                # a request's first sentence, finished before the drain
        assert until_ping(1) == []
        engine.push(EngineOutput(request_id="sp/s1", token_ids=[2], finished=True))
        assert recv(s).finished
        assert w.command("DRAIN") == (True, "draining")
        add("r1")                                   # its next piece
        add("sp/s2")                                # its next sentence: nothing of "sp" is in flight now
        add("new")
        refused = until_ping(2)
        assert [(e.request_id, type(e)) for e in refused] == [("new", m.RequestError)]
        assert "draining" in refused[0].message
        assert engine.ids == ["r1", "sp/s1", "r1", "sp/s2"]
        for rid in ("r1", "sp/s2"):                 # and they finish there
            engine.push(EngineOutput(request_id=rid, token_ids=[3], finished=True))
            out = recv(s)
            assert out.request_id == rid and out.finished
        s.close()
    finally:
        next(gen, None)
