"""The frontend's topology view across a master restart: a resync's snapshot that comes before
the stages registered again keeps them for one lease TTL, and a stage that registers again as the
same process is its old self (no REMOVED, its serving state kept, what it holds goes on)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from omni.errors import Unavailable
from omni.master.types import TopologyEvent
from omni.orchestrator import events as ev
from omni.orchestrator.topology import Topology
from tests.unit.test_orchestrator_core import ALL, chat, ids, make_core, of, output, replica, sends


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def watched(core) -> tuple[list, list]:
    """(kinds seen, actions of ReplicaGone), the executor's way: a stage REMOVED is gone for the core."""
    seen, acts = [], []

    def on_change(r, kind):
        seen.append((r.replica_id, kind, r.state))
        if kind == "REMOVED":
            acts.extend(core.handle(ev.ReplicaGone(r, "gone")))
    core.topology.on_change(on_change)
    return seen, acts


def registering(r):
    return msgspec.structs.replace(r, state="REGISTERING")


def test_a_master_restart_keeps_in_flight_requests_on_the_stages_that_register_again():
    core = make_core(*ALL)
    clock = Clock()
    core.topology.grace_s, core.topology._clock = 5.0, clock
    seen, gone = watched(core)
    core.submit(chat())
    core.handle(output("s0r0", 0, "r1", token_ids=ids("Hi. Yo")))        # the talker took "Hi.": started
    # The new master's snapshot: only the thinker registered again so far (REGISTERING, no heartbeat yet).
    core.topology.apply(TopologyEvent("SNAPSHOT", [registering(ALL[0])], 1))
    assert not gone and [k for _, k, _ in seen] == ["UPDATED"]
    assert {r.replica_id: r.state for r in core.topology.replicas.values()} == {
        "s0r0": "READY", "s1r0": "READY", "s2r0": "READY"}
    assert core.topology.expiry_in() == 5.0
    # The talker registers again as the same process: its old self, not a new REGISTERING replica.
    clock.t += 1.0
    core.topology.apply(TopologyEvent("ADDED", [registering(ALL[1])], 2))
    assert seen[-1] == ("s1r0", "UPDATED", "READY") and core.topology.expiry_in() == 4.0
    acts = core.handle(output("s0r0", 0, "r1", token_ids=ids("!"), finished=True, finish_reason="stop"))
    assert sends(acts) == [("s1r0", "r1/s2", True)] and not of(acts, ev.Fail)    # the next sentence goes on
    core.topology.apply(TopologyEvent("ADDED", [registering(ALL[2])], 3))
    core.topology.apply(TopologyEvent("UPDATED", list(ALL), 4))                # their first heartbeats
    clock.t += 10.0
    core.topology.expire()
    assert not gone and "REMOVED" not in [k for _, k, _ in seen] and core.topology.expiry_in() is None
    assert sends(core.submit(chat("r2"))) == [("s0r0", "r2", True)]


def test_a_replica_that_does_not_come_back_within_the_grace_is_removed_then():
    core = make_core(*ALL)
    clock = Clock()
    core.topology.grace_s, core.topology._clock = 5.0, clock
    seen, gone = watched(core)
    core.submit(chat())
    core.handle(output("s0r0", 0, "r1", token_ids=ids("Hi. Yo")))
    core.topology.apply(TopologyEvent("SNAPSHOT", [ALL[0], ALL[2]], 1))
    clock.t += 4.9
    core.topology.expire()
    assert not gone and "s1r0" in core.topology.replicas
    # A second reconnect meanwhile does not extend its time.
    core.topology.apply(TopologyEvent("SNAPSHOT", [ALL[0], ALL[2]], 1))
    assert abs(core.topology.expiry_in() - 0.1) < 1e-9
    clock.t += 0.1
    core.topology.expire()
    assert ("s1r0", "REMOVED", "READY") in seen and "s1r0" not in core.topology.replicas
    fail = of(gone, ev.Fail)[0].error
    assert "stage 1 replica s1r0: replica is gone" in str(fail)
    with pytest.raises(Unavailable, match="stage 1"):
        core.submit(chat("r2"))


def test_another_process_under_a_kept_replicas_id_is_the_old_one_removed_and_a_new_one():
    core = make_core(*ALL)
    core.topology.grace_s = 5.0
    seen, gone = watched(core)
    core.submit(chat())
    core.handle(output("s0r0", 0, "r1", token_ids=ids("Hi")))
    core.topology.apply(TopologyEvent("SNAPSHOT", [ALL[1], ALL[2]], 1))
    assert not gone
    other = msgspec.structs.replace(ALL[0], pid=2, endpoints={"channel": "tcp://h1:2"}, state="REGISTERING")
    core.topology.apply(TopologyEvent("ADDED", [other], 2))
    assert seen[-2:] == [("s0r0", "REMOVED", "READY"), ("s0r0", "ADDED", "REGISTERING")]
    assert "replica is gone" in str(of(gone, ev.Fail)[0].error) and core.topology.expiry_in() is None


def test_no_grace_removes_at_once_and_a_snapshots_registering_replica_of_another_process_is_new():
    topo = Topology()
    seen = []
    topo.on_change(lambda r, kind: seen.append((r.replica_id, kind, r.state)))
    topo.apply(TopologyEvent("SNAPSHOT", [replica(0, "s0r0"), replica(1, "s1r0", state="DRAINING")], 1))
    topo.apply(TopologyEvent("SNAPSHOT", [registering(replica(1, "s1r0"))], 2))
    assert seen[2:] == [("s0r0", "REMOVED", "READY"), ("s1r0", "UPDATED", "DRAINING")]   # kept its drain
    topo.apply(TopologyEvent("UPDATED", [replica(1, "s1r0", state="SUSPECT")], 3))
    topo.apply(TopologyEvent("UPDATED", [registering(replica(1, "s1r0"))], 4))
    assert seen[-1] == ("s1r0", "UPDATED", "REGISTERING")       # not serving before: as the master says


class FakeWatchMaster:
    """watch() streams: the first ends (the master went away), the second sends a snapshot without s0r0."""

    def __init__(self):
        self.calls = 0
        self.done = asyncio.Event()

    async def watch(self):
        from omni.errors import OmniError

        self.calls += 1
        if self.calls == 1:
            yield TopologyEvent("SNAPSHOT", [replica(0, "s0r0"), replica(1, "s1r0")], 1)
            raise OmniError("master went away")
        yield TopologyEvent("SNAPSHOT", [replica(1, "s1r0")], 1)
        await self.done.wait()


def test_follow_topology_drops_a_replica_missing_after_a_reconnect_once_the_grace_is_over():
    from omni.frontend import follow_topology

    async def main():
        topo, master, stop = Topology(grace_s=0.3), FakeWatchMaster(), asyncio.Event()
        removed = asyncio.Event()
        topo.on_change(lambda r, kind: kind == "REMOVED" and removed.set())
        task = asyncio.create_task(follow_topology(master, topo, stop))
        while master.calls < 2:
            await asyncio.sleep(0.01)
        assert "s0r0" in topo.replicas and not removed.is_set()
        await asyncio.wait_for(removed.wait(), 3)
        assert "s0r0" not in topo.replicas
        stop.set()
        master.done.set()
        await asyncio.wait_for(task, 3)
    asyncio.run(main())
