"""Replica picking: a sleeping replica takes no new request and no replay while an awake one is
there (it would answer 'asleep' and, reporting no load, be the least loaded), and is picked only
when none is awake, so the client gets its 'asleep' 503."""

from __future__ import annotations

import msgspec

from omni.master.types import TopologyEvent
from omni.orchestrator import events as ev
from tests.unit.test_orchestrator_core import chat, make_core, replica, sends


def asleep(r):
    return msgspec.structs.replace(r, is_sleeping=True)


def test_new_requests_go_to_an_awake_replica_even_a_busier_one_and_to_a_sleeping_one_only_if_none_is_awake():
    busy = msgspec.structs.replace(replica(0, "s0r1"), in_flight=5)
    core = make_core(asleep(replica(0, "s0r0")), busy, replica(1, "s1r0"), replica(2, "s2r0"))
    assert sends(core.submit(chat("r1", modalities=("text",)))) == [("s0r1", "r1", True)]
    assert sends(core.submit(chat("r2", modalities=("text",)))) == [("s0r1", "r2", True)]
    core.topology.apply(TopologyEvent("UPDATED", [asleep(busy)], 2))
    assert sends(core.submit(chat("r3", modalities=("text",)))) == [("s0r0", "r3", True)]   # least loaded of all


def test_a_replay_goes_to_an_awake_replica_and_to_a_sleeping_one_only_if_none_is_awake():
    busy = msgspec.structs.replace(replica(0, "s0r2"), in_flight=5)
    for others, expect in (((asleep(replica(0, "s0r1")), busy), "s0r2"), ((asleep(replica(0, "s0r1")),), "s0r1")):
        core = make_core(replica(0, "s0r0"), *others, replica(1, "s1r0"), replica(2, "s2r0"))
        assert sends(core.submit(chat(modalities=("text",)))) == [("s0r0", "r1", True)]
        dead = replica(0, "s0r0", state="SUSPECT")
        core.topology.apply(TopologyEvent("UPDATED", [dead], 2))
        assert sends(core.handle(ev.ReplicaGone(dead, "suspect"))) == [(expect, "r1", True)]
