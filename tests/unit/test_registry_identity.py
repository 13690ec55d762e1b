"""Which registrant may take a live replica's slot: only its own process registering again, told apart from
another process with the same host and pid (two containers on one host, host networking) by its instance id."""

from __future__ import annotations

from omni._proto import master_pb2 as pb
from omni.master.client import MasterClient
from omni.master.configdiff import hash_config
from omni.master.registry import RegisterInput, Registry, ReplicaState, Role
from omni.master.server import MasterServer

CFG = {"model": "m", "stages": [{"stage_id": 0, "name": "a"}]}
HASH = hash_config(CFG)


def _input(instance_id: str, channel: str) -> RegisterInput:
    return RegisterInput(role=Role.STAGE, stage_id=0, host="10.0.0.5", pid=25, config_hash=HASH, replica_hint=0,
                         endpoints={"channel": channel}, instance_id=instance_id)


def test_a_live_slot_is_taken_only_by_the_same_instance():
    reg = Registry(CFG, HASH)
    a, _ = reg.register(_input("A", "tcp://10.0.0.5:5000"))
    b, events = reg.register(_input("B", "tcp://10.0.0.5:5001"))    # another container, same host and pid
    assert (a.replica_id, b.replica_id) == ("s0r0", "s0r1") and [e.kind for e in events] == ["ADDED"]
    assert reg.lookup(a.lease_id).state is ReplicaState.REGISTERING
    again, events = reg.register(_input("A", "tcp://10.0.0.5:5000"))  # A itself, its lease lost
    assert again.replica_id == "s0r0" and [(e.kind, e.replica.lease_id) for e in events] == [
        ("REMOVED", a.lease_id), ("ADDED", again.lease_id)]
    assert reg.lookup(b.lease_id) is not None


def test_an_older_client_without_an_instance_id_is_told_by_host_and_pid_as_before():
    reg = Registry(CFG, HASH)
    a, _ = reg.register(_input("", "tcp://10.0.0.5:5000"))
    again, _ = reg.register(_input("", "tcp://10.0.0.5:5000"))
    assert again.replica_id == "s0r0" and reg.lookup(a.lease_id) is None


def test_two_clients_with_one_host_and_pid_keep_two_slots_on_a_real_master(monkeypatch):
    sent: list[pb.RegisterRequest] = []
    server = MasterServer(CFG, HASH, lease_ttl_s=5.0)
    server.start()
    clients = [MasterClient(server.address), MasterClient(server.address)]
    try:
        regs = [c.register("STAGE", 0, config_hash=HASH, host="10.0.0.5", pid=25, replica_hint=0,
                           endpoints={"channel": f"tcp://10.0.0.5:{5000 + i}"}) for i, c in enumerate(clients)]
        assert [r.replica_id for r in regs] == ["s0r0", "s0r1"]
        st = clients[0].get_status()
        assert sorted(r.replica_id for r in st.replicas) == ["s0r0", "s0r1"]
        # a re-registration (lease lost) keeps the client's instance id: it takes its own slot back
        unary = clients[0]._unary
        monkeypatch.setattr(clients[0], "_unary", lambda m, req, **kw: sent.append(req) or unary(m, req, **kw))
        assert clients[0]._reregister().replica_id == "s0r0"
        assert sent[0].instance_id and sent[0].instance_id == clients[0]._reg_request.instance_id
        assert sent[0].instance_id != clients[1]._reg_request.instance_id
        assert sorted(r.replica_id for r in clients[1].get_status().replicas) == ["s0r0", "s0r1"]
    finally:
        for c in clients:
            c.close()
        server.stop(grace=0.2)
