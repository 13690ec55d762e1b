"""A replica restarted under the same id (the registry reuses a gone replica's id) starts its keys at 1
again: a free meant for its predecessor's tensors must not free its own. Refs name the producer that
made them (TensorRef.incarnation), the orchestrator's Free and the FreeTensors carry it, and a stage
ignores a free of another producer's keys."""

from __future__ import annotations

import msgspec
import pytest
import torch

from omni.config import StageConfig
from omni.master.types import TopologyEvent
from omni.orchestrator import events as ev
from omni.orchestrator.fetch import Fetcher
from omni.orchestrator.types import PipelineRequest
from omni.stage import messages as m
from omni.stage.worker import StageWorker
from omni.transport.shm import ShmConsumer, ShmProducer
from tests.unit.test_orchestrator_core import make_core, of, output, ref, replica
from tests.unit.test_stage_worker_published import OneShot


def test_a_free_names_the_producer_that_made_the_tensors():
    core = make_core(replica(0, "s0r0"), replica(1, "s1r0"), replica(2, "s2r0"))
    core.submit(PipelineRequest(request_id="sp", text="Hi.", entry_stage=1, modalities=("audio",)))
    old_ref = msgspec.structs.replace(ref(1), incarnation="omni-shm-1-aaaa")
    core.handle(output("s1r0", 1, "sp", tensors={"latents": old_ref}, finished=True))
    old = replica(1, "s1r0", state="DEAD")      # the talker goes; a new process takes its id
    core.topology.apply(TopologyEvent("UPDATED", [old], 2))
    core.handle(ev.ReplicaGone(old, "dead"))
    new = msgspec.structs.replace(replica(1, "s1r0"), pid=2, endpoints={"channel": "tcp://h1:2"})
    core.topology.apply(TopologyEvent("REMOVED", [old], 3))
    core.topology.apply(TopologyEvent("ADDED", [new], 4))
    acts = core.handle(output("s2r0", 2, "sp", tensors={"audio": ref(7, "s2r0")}, sample_rate=24000,
                              finished=True))
    assert ev.Free("s1r0", "shm", (1,), "omni-shm-1-aaaa") in of(acts, ev.Free)


@pytest.fixture
def restarted():
    """A stage worker on a real shm producer that published key 1, and its predecessor's incarnation."""
    old = ShmProducer(arena_bytes=1 << 20)
    gone = old.incarnation
    old.close()
    prod = ShmProducer(arena_bytes=1 << 20)
    w = StageWorker(StageConfig(stage_id=1, engine="count", name="talker"),
                    OneShot(lambda: {"latents": torch.full((4,), 1.0)}), make_producer=lambda k: prod)
    w._frontends.add(b"fe")
    sent: list[bytes] = []
    w._send_frame = lambda ident, frame: sent.append(frame) or True
    w._handle(b"fe", m.AddRequest(request_id="sp2", prompt_token_ids=[1], out_transport="shm", out_tensors=True))
    w._step()
    out = msgspec.msgpack.Decoder(m.FromStage).decode(sent[-1])
    consumer = ShmConsumer()
    yield w, prod, out.tensors["latents"], gone, consumer
    consumer.close()
    w.close()


def test_a_restarted_stage_ignores_its_predecessors_free(restarted):
    w, prod, new_ref, gone, consumer = restarted
    assert new_ref.key == 1 and new_ref.incarnation == prod.incarnation != gone
    view = consumer.get(new_ref)                     # a consumer's zero-copy view of the new key 1
    w._handle(b"fe", m.FreeTensors([1], "shm", gone))   # meant for the old process's key 1
    assert prod.bytes_in_use() > 0 and len(w._published) == 1
    prod.put(torch.full((4,), 9.0))                  # the next output does not take key 1's slot
    assert view.tolist() == [1.0] * 4 and consumer.get(new_ref).tolist() == [1.0] * 4
    w._handle(b"fe", m.FreeTensors([1], "shm", prod.incarnation))   # its own: freed
    assert len(w._published) == 0


def test_producers_name_themselves_apart():
    a, b = ShmProducer(arena_bytes=1 << 20), ShmProducer(arena_bytes=1 << 20)
    try:
        ra, rb = a.put(torch.zeros(2)), b.put(torch.zeros(2))
        assert ra.key == rb.key and ra.incarnation and ra.incarnation != rb.incarnation
    finally:
        a.close()
        b.close()


def test_a_deferred_free_waits_only_for_a_read_of_the_same_producer():
    f = Fetcher()
    f._reading[("s1r0", "tcp", 1, "new")] = 1        # the new process's key 1 is being read
    assert f.hold("s1r0", "tcp", (1,), "ch", "old") == (1,)    # the old one's: not held for it
    assert f.hold("s1r0", "tcp", (1,), "ch", "new") == ()
