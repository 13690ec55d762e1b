"""A stage worker's output producers: what the stage publishes is freed by what the frontend
sends back, whatever name the connector gave the transport, and a producer's failure fails
only the request it was publishing."""

from __future__ import annotations

import pytest
import torch

from omni.config import StageConfig
from omni.engines.base import Engine, EngineOutput
from omni.stage import messages as m
from omni.stage.worker import StageWorker
from omni.transport.base import ProducerFull, TensorRef
from omni.transport.factory import make_producer


class OneShot(Engine):
    """Each request finishes at its first step with the tensors `tensors()` makes."""

    def __init__(self, tensors):
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


class Labelled:
    """A producer that labels its refs `label` whatever it was made as (GlooProducer: "nccl" for
    a CUDA tensor on a connector named `gloo`), holding up to `room` tensors."""

    def __init__(self, label, room=10):
        self.label, self.room = label, room
        self.slots: dict[int, str] = {}
        self.n = 0

    def put(self, t, owner=""):
        if len(self.slots) >= self.room:
            raise ProducerFull("full")
        self.n += 1
        self.slots[self.n] = owner
        return TensorRef(transport=self.label, endpoint="x", key=self.n, dtype="float32",
                         shape=tuple(t.shape), nbytes=t.numel() * 4, owner=owner)

    def free(self, keys):
        for k in keys:
            self.slots.pop(k, None)

    def free_owner(self, owner):
        for k in [k for k, o in self.slots.items() if o == owner]:
            del self.slots[k]

    def close(self):
        pass


@pytest.mark.parametrize("configured,label", [("gloo", "nccl"), ("nccl", "gloo")])
def test_a_partly_published_output_is_freed_under_the_refs_name(configured, label):
    """Room for one of an output's two tensors: the first is freed again and the output held.
    free_refs looked the producer up by the ref's name: a KeyError that killed the stage."""
    prod = Labelled(label, room=1)
    w, sent = worker(OneShot(lambda: {"a": torch.zeros(4), "b": torch.zeros(4)}), lambda kind: prod)
    try:
        request(w, "r0", configured)
        assert prod.slots == {} and w._held and not sent
        prod.room = 2
        w._flush_held()
        assert not w._held and set(sent[-1].tensors) == {"a", "b"}
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
