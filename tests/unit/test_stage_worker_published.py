"""A stage's published tensors of requests it finished: freed when their frontend goes, when
the request is aborted later, or when the finishing output is dropped unsent."""

from __future__ import annotations

import pytest
import torch

from omni.config import StageConfig
from omni.engines.base import Engine, EngineOutput
from omni.stage import messages as m
from omni.stage.worker import StageWorker
from omni.transport.base import TensorRef


class Producer:
    """Slots by key, with their owner, as the arena producers keep them."""

    def __init__(self):
        self.slots: dict[int, str] = {}
        self.n = 0

    def put(self, t, owner=""):
        self.n += 1
        self.slots[self.n] = owner
        return TensorRef(transport="shm", endpoint="x", key=self.n, dtype="float32", shape=tuple(t.shape),
                         nbytes=t.numel() * 4)

    def free(self, keys):
        for k in keys:
            self.slots.pop(k, None)

    def free_owner(self, owner):
        for k in [k for k, o in self.slots.items() if o == owner]:
            del self.slots[k]

    def close(self):
        pass


class OneShot(Engine):
    """Each request finishes at its first step with the tensors `tensors()` makes (one, by default)."""

    def __init__(self, tensors=lambda: {"h": torch.zeros(4)}):
        self.reqs: list[str] = []
        self.tensors = tensors
        self.aborted: list[str] = []

    def add_request(self, r):
        self.reqs.append(r.request_id)

    def abort(self, rid):
        self.aborted.append(rid)

    def step(self):
        out = [EngineOutput(request_id=r, tensors=self.tensors(), finished=True, finish_reason="stop")
               for r in self.reqs]
        self.reqs = []
        return out

    def has_unfinished(self):
        return bool(self.reqs)


@pytest.fixture
def setup():
    prod = Producer()
    w = StageWorker(StageConfig(stage_id=0, engine="count", name="thinker"), OneShot(), make_producer=lambda k: prod)
    w._frontends.update({b"fe", b"fe2"})
    sent: list[tuple[bytes, bytes]] = []
    w._send_frame = lambda ident, frame: sent.append((ident, frame)) or True
    yield w, prod, sent
    w.close()


def finish(w: StageWorker, rid: str, ident: bytes = b"fe") -> None:
    w._handle(ident, m.AddRequest(request_id=rid, prompt_token_ids=[1], out_transport="shm", out_tensors=True))
    w._step()


def test_a_gone_frontend_frees_the_tensors_of_requests_finished_here(setup):
    w, prod, _ = setup
    finish(w, "r1")
    finish(w, "r2", b"fe2")
    assert sorted(prod.slots.values()) == ["r1", "r2"] and not w._reqs
    w._frontend_gone(b"fe", "closed")
    assert list(prod.slots.values()) == ["r2"]           # the other frontend's are still read


def test_an_abort_after_the_finish_frees_what_the_frontend_did_not(setup):
    w, prod, _ = setup
    finish(w, "r1")
    w._handle(b"fe", m.Abort(["r1"]))
    assert prod.slots == {}


def test_tensors_the_frontend_freed_are_forgotten(setup):
    w, prod, _ = setup
    finish(w, "r1")
    w._handle(b"fe", m.FreeTensors([1], "shm"))
    assert prod.slots == {} and len(w._published) == 0
    finish(w, "r2")                                       # slot 2: freed by owner when fe goes
    w._frontend_gone(b"fe", "closed")
    assert prod.slots == {} and len(w._published) == 0


def test_a_finishing_output_dropped_unsent_frees_its_tensors(setup):
    w, prod, _ = setup
    w._send_frame = lambda ident, frame: False            # the frontend reads nothing
    w.stall_timeout_s = -1.0
    finish(w, "r1")
    assert prod.slots == {1: "r1"} and w._held and not w._reqs
    w._flush_held()
    assert not w._held and prod.slots == {}


def test_a_piece_that_reaches_a_stage_after_it_ended_the_stream_is_dropped(setup):
    """The talker ends its stream (max_tokens, its codec's end) while the thinker's next pieces are on
    their way to it: those are late pieces, not a new request (the talker refused one as a request
    without a prompt, a 400 that failed the whole chat)."""
    w, prod, sent = setup
    finish(w, "r1")
    n = len(sent)
    w._handle(b"fe", m.AddRequest(request_id="r1", generated_ids=[5], final=False))
    w._handle(b"fe", m.AddRequest(request_id="r1", final=True))
    assert w.engine.reqs == [] and not w._reqs and len(sent) == n
    w._step()
    assert len(sent) == n
    finish(w, "r2")                       # other requests go on
    assert len(sent) == n + 1 and not w._reqs


def test_a_request_failed_here_is_reported_before_its_tensors_are_freed(setup):
    """A frontend may be reading the request's last output (a remote read on its pool): the stage's
    error goes out first, so the frontend likely has the failure before that read finds its tensor
    gone, and the client gets the stage's error rather than the read's."""
    w, prod, sent = setup
    held_at_send: list[dict] = []
    w._send_frame = lambda ident, frame: held_at_send.append(dict(prod.slots)) or True
    w._handle(b"fe", m.AddRequest(request_id="r1", prompt_token_ids=[1], out_transport="shm", out_tensors=True))
    w.engine.step = lambda: [EngineOutput(request_id="r1", tensors={"h": torch.zeros(4)})]
    w._step()
    assert prod.slots == {1: "r1"}
    w.engine.step = lambda: [EngineOutput(request_id="r1", error="boom")]
    w._step()
    assert held_at_send[-1] == {1: "r1"} and prod.slots == {} and not w._reqs


def test_a_zmq_frontend_that_dies_after_the_finish_has_its_tensors_freed_after_the_ttl():
    """A frontend on ZMQ (another host, or after a fallback from the local channel) that dies after a
    request finished here, before its FreeTensors: nothing is sent to it again, so the stage never saw
    it go and held those tensors until the replica restarted. They go published_ttl_s (the pipeline's
    request_timeout_s) after their publish; before that, nothing is freed."""
    import threading
    import time

    import msgspec

    from tests.unit.test_stage_worker import dealer

    prod = Producer()
    w = StageWorker(StageConfig(stage_id=0, engine="count", name="thinker"), OneShot(), token="secret",
                    make_producer=lambda k: prod, published_ttl_s=1.5)
    t = threading.Thread(target=w.run, kwargs={"grace_s": 1.0}, daemon=True)
    t.start()
    try:
        enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(m.FromStage)
        for i in range(2):
            s = dealer(w.endpoint, ident=b"fe-%d" % i)
            s.send(enc.encode(m.Hello(f"fe-{i}", "secret")))
            assert dec.decode(s.recv()).ok
            s.send(enc.encode(m.AddRequest(request_id=f"r{i}", prompt_token_ids=[1], out_transport="shm")))
            out = dec.decode(s.recv())
            assert out.finished and prod.slots[out.tensors["h"].key] == f"r{i}"
            if i == 1:      # a live frontend frees its own
                s.send(enc.encode(m.FreeTensors([out.tensors["h"].key], "shm")))
            s.close(0)      # the other dies without a word
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline and prod.slots != {1: "r0"}:
            time.sleep(0.01)
        assert prod.slots == {1: "r0"}
        time.sleep(0.5)
        assert prod.slots == {1: "r0"}          # not before the ttl
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and prod.slots:
            time.sleep(0.05)
        assert prod.slots == {} and len(w._published) == 0
    finally:
        w.stop()
        t.join(10)


def test_only_requests_done_here_go_stale_and_only_after_the_ttl(monkeypatch):
    from omni.stage import published

    now = [100.0]
    monkeypatch.setattr(published.time, "monotonic", lambda: now[0])
    p = published.Published(ttl_s=10.0)
    ref = lambda k: TensorRef(transport="shm", endpoint="x", key=k, dtype="float32", shape=(1,), nbytes=4)  # noqa: E731
    p.add(b"fe", "old", [ref(1)])
    p.add(b"fe", "live", [ref(2)])
    now[0] = 105.0
    p.add(b"fe", "new", [ref(3)])
    p.add(b"fe", "none", [])                     # nothing published: nothing to free
    now[0] = 110.0
    assert p.stale({"live"}) == ["old"]
    assert p.stale(set()) == []                  # looks once a SWEEP_S
    now[0] = 111.5
    p.add(b"fe", "old", [ref(4)])                # publishes again: its clock restarts
    assert p.stale(set()) == ["live"]
    p.freed("shm", [2])
    now[0] = 130.0
    assert p.stale(set()) == ["new", "old"]
