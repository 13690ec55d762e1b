"""A stage worker's output producers: what the stage publishes is freed by what the frontend
sends back, whatever name the connector gave the transport, and a producer's failure fails
only the request it was publishing."""

from __future__ import annotations

import pytest
import torch

from omni.config import StageConfig
from omni.stage import messages as m
from omni.stage.worker import StageWorker
from omni.transport.base import ProducerFull, TensorRef
from omni.transport.factory import make_producer
from tests.unit.test_stage_worker_published import OneShot, Producer


def worker(engine, make):
    w = StageWorker(StageConfig(stage_id=0, engine="count", name="thinker"), engine, make_producer=make)
    w._frontends.add(b"fe")
    sent: list = []
    dec = m.frontend_codec()
    w._send_frame = lambda ident, frame: sent.append(dec.decode(frame)) or True
    return w, sent


def request(w, rid, transport):
    w._handle(b"fe", m.AddRequest(request_id=rid, prompt_token_ids=[1], out_transport=transport, out_tensors=True))
    w._step()


@pytest.mark.parametrize("configured", ["nccl", "gloo"])
def test_a_gloo_edge_frees_what_its_frontend_frees_under_either_name(configured):
    """A connector set to `nccl` with a CPU tensor: the producer labels the ref "gloo" (by the
    tensor's device); the frontend frees it under that name. It was never freed (the producer
    was kept under "nccl"), so the stage's memory grew until ProducerFull."""
    made = {}

    def make(kind):
        made[kind] = make_producer(kind, host="127.0.0.1", token="t")
        return made[kind]

    w, sent = worker(OneShot(lambda: {"h": torch.zeros(256)}), make)
    try:
        for i in range(3):
            request(w, f"r{i}", configured)
            ref = sent[-1].tensors["h"]
            assert ref.transport == "gloo"
            w._handle(b"fe", m.FreeTensors([ref.key], ref.transport))
            assert made[configured].bytes_in_use() == 0 and len(w._published) == 0
        assert list(made) == [configured]
    finally:
        w.close()


class Labelled(Producer):
    """A producer that labels its refs `label` whatever it was made as (GlooProducer: "nccl" for
    a CUDA tensor on a connector named `gloo`), holding up to `room` tensors."""

    def __init__(self, label, room=10):
        super().__init__()
        self.label, self.room = label, room

    def put(self, t, owner=""):
        if len(self.slots) >= self.room:
            raise ProducerFull("full")
        self.n += 1
        self.slots[self.n] = owner
        return TensorRef(transport=self.label, endpoint="x", key=self.n, dtype="float32",
                         shape=tuple(t.shape), nbytes=t.numel() * 4, owner=owner)

    def bytes_in_use(self):
        return 16 * len(self.slots)

    def capacity_bytes(self):
        return 16 * self.room


@pytest.mark.parametrize("configured,label", [("gloo", "nccl"), ("nccl", "gloo")])
def test_a_partly_published_output_is_freed_under_the_refs_name(configured, label):
    """With another request's two tensors held, room for one of an output's two: the first is freed
    again and the output held. free_refs looked the producer up by the ref's name: a KeyError that
    killed the stage."""
    prod = Labelled(label, room=3)
    w, sent = worker(OneShot(lambda: {"a": torch.zeros(4), "b": torch.zeros(4)}), lambda kind: prod)
    try:
        request(w, "r0", configured)
        request(w, "r1", configured)
        assert list(prod.slots.values()) == ["r0", "r0"] and w._held and len(sent) == 1
        w._handle(b"fe", m.FreeTensors([r.key for r in sent[0].tensors.values()], label))
        w._flush_held()
        assert not w._held and sent[-1].request_id == "r1" and set(sent[-1].tensors) == {"a", "b"}
        w._handle(b"fe", m.FreeTensors([r.key for r in sent[-1].tensors.values()], label))
        assert prod.slots == {} and len(w._published) == 0
    finally:
        w.close()


class Breaking(Labelled):
    """Its `fail_at`-th put raises an error no transport names (a bug, a CUDA error torch raises)."""

    def __init__(self, fail_at):
        super().__init__("shm")
        self.puts, self.fail_at = 0, fail_at

    def put(self, t, owner=""):
        self.puts += 1
        if self.puts == self.fail_at:
            raise RuntimeError("copy engine on fire")
        return super().put(t, owner)


def test_a_producer_error_fails_that_request_only_and_frees_what_it_put():
    """An error other than TransportError/ValueError from a put went up through _step and killed the stage."""
    prod = Breaking(fail_at=2)
    w, sent = worker(OneShot(lambda: {"a": torch.zeros(4), "b": torch.zeros(4)}), lambda kind: prod)
    try:
        request(w, "r0", "shm")
        err = sent[-1]
        assert isinstance(err, m.RequestError) and err.request_id == "r0"
        assert "RuntimeError" in err.message and "copy engine on fire" in err.message
        assert prod.slots == {} and len(w._published) == 0 and not w._reqs and w.engine.aborted == ["r0"]
        request(w, "r1", "shm")                    # the stage goes on
        assert isinstance(sent[-1], m.Output) and set(sent[-1].tensors) == {"a", "b"}
    finally:
        w.close()


@pytest.mark.parametrize("kind,opts,floats,why", [
    ("shm", {"arena_bytes": 4096, "max_segments": 1}, 600, "4800 bytes > 4096"),
    ("shm", {"arena_bytes": 4096, "max_segments": 1}, 500, "4000 bytes in 2 tensors, in aligned slots, do not fit 4096"),
    ("tcp", {"max_bytes_held": 3000}, 400, "3200 bytes > 3000"),
])
def test_an_output_that_can_never_fit_fails_its_request_at_once(kind, opts, floats, why):
    """Each tensor fits the producer, the output does not, even with nothing else held: it was held,
    the stage stepped nothing for stall_timeout_s (60 s), then the request failed saying consumers
    must free tensors. Now it fails at once naming the setting; an output that fits goes on."""
    made = []

    def make(k):
        made.append(make_producer(k, **opts))
        return made[-1]

    size = [floats]
    w, sent = worker(OneShot(lambda: {"a": torch.ones(size[0]), "b": torch.ones(size[0])}), make)
    w.stall_timeout_s = 3600.0
    try:
        request(w, "r0", kind)
        err = sent[-1]
        assert isinstance(err, m.RequestError) and err.request_id == "r0" and not w._held
        limit = "arena_bytes" if kind == "shm" else "max_bytes_held"
        assert f"too large for the connector's {kind}" in err.message and why in err.message
        assert err.message.endswith(f"raise {limit}")
        assert made[0].bytes_in_use() == 0 and not w._reqs
        size[0] = 100
        request(w, "r1", kind)
        assert isinstance(sent[-1], m.Output) and set(sent[-1].tensors) == {"a", "b"}
    finally:
        w.close()


def test_an_output_that_fits_once_others_are_freed_waits():
    """Backpressure is unchanged: with another request's tensors held, an output that fits the
    empty arena waits for them to be freed."""
    w, sent = worker(OneShot(lambda: {"a": torch.ones(400)}),
                     lambda k: make_producer(k, arena_bytes=4096, max_segments=1))
    try:
        request(w, "r0", "shm")
        request(w, "r1", "shm")
        request(w, "r2", "shm")                  # 3 x (1600 + 64) > 4096: held
        assert len(sent) == 2 and w._held
        w._handle(b"fe", m.FreeTensors([sent[0].tensors["a"].key], "shm"))
        w._flush_held()
        assert len(sent) == 3 and isinstance(sent[-1], m.Output) and not w._held
    finally:
        w.close()
