"""What one registrant or heartbeat may put into the master's registry: every entry goes out whole in each
GetStatus and topology snapshot, so an oversize one broke `omni status`, the launcher's readiness wait and every
frontend's topology for everyone."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from omni._proto import master_pb2 as pb
from omni._proto import master_pb2_grpc as pb_grpc
from omni.errors import BadRequest, OmniError
from omni.master import kv, limits
from omni.master import server as server_mod
from omni.master.client import AsyncMasterClient, MasterClient
from omni.master.configdiff import hash_config
from omni.master.errors import from_rpc_error
from omni.master.kv import KvFull, KvStore, Limits
from omni.master.registry import RegisterInput, Registry, RegistryFull, ReplicaState, Role
from omni.master.server import MasterServer

CFG = {"model": "m", "stages": [{"stage_id": 0, "name": "a"}]}
HASH = hash_config(CFG)
BIG = "x" * (3 << 20)


@pytest.fixture
def master():
    server = MasterServer(CFG, HASH, lease_ttl_s=5.0)
    server.start()
    channel = grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 8 << 20)])
    try:
        yield server, pb_grpc.MasterStub(channel)
    finally:
        channel.close()
        server.stop(grace=0.2)


def _refusal(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


@pytest.mark.parametrize("fields, names", [
    ({"host": "h" * 256}, "host: 256 bytes, at most 255"),
    ({"version": "v" * 300}, "version: 300 bytes"),
    ({"capabilities": {"c": BIG}}, "capabilities['c']: key and value at most 1024 bytes each"),
    ({"endpoints": {f"e{i}": "x" for i in range(65)}}, "endpoints: 65 entries, at most 64"),
    ({"capabilities": {f"c{i}": "x" * 1000 for i in range(9)}}, "endpoints and capabilities: 9"),
    ({"pipeline_config_json": '{"stages": [], "pad": "' + "x" * (1 << 20) + '"}'}, "pipeline_config_json: 1048"),
    ({"instance_id": "i" * 65}, "instance_id: 65 bytes, at most 64"),      # kept in the entry
    ({"instance_id": BIG}, "instance_id: 3145728 bytes"),
    ({"config_hash": "c" * 129}, "config_hash: 129 bytes, at most 128"),
])
def test_an_oversize_registration_is_refused_naming_the_field(master, fields, names):
    server, stub = master
    req = {"role": pb.FRONTEND, "host": "evil", "pid": 1, "config_hash": HASH, **fields}
    code, details = _refusal(lambda: stub.Register(pb.RegisterRequest(**req)))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and names in details, details
    with MasterClient(server.address) as c:
        assert c.get_status().replicas == []


def test_a_config_hash_a_master_without_a_config_would_adopt_is_bounded():
    """The first registrant's config_hash went out in every StatusResponse: 3 MiB of it passed gRPC's
    default 4 MiB receive limit with the rest, so an older client's GetStatus failed."""
    server = MasterServer(None, None, lease_ttl_s=5.0)
    server.start()
    try:
        with MasterClient(server.address) as c:
            with pytest.raises(BadRequest, match="config_hash: 3145728 bytes, at most 128"):
                c.register("FRONTEND", config_hash=BIG, pipeline_config=CFG, host="h", pid=1)
            status = c.get_status()
            assert status.config_hash == "" and status.replicas == []
            c.register("FRONTEND", config_hash=HASH, pipeline_config=CFG, host="h", pid=1)
            assert c.get_status().config_hash == HASH
    finally:
        server.stop(grace=0.2)


def test_what_a_real_stage_sends_is_well_inside():
    endpoints = {"channel": "tcp://203.0.113.200:45678", "local": "ipc:///tmp/omni-xxxxxxxx/stage-0-0.sock"}
    capabilities = {"can_sleep": "true", "engine": "vllm", "max_model_len": "32768", "max_prompt_len": "32768"}
    client = MasterClient("127.0.0.1:1")        # its instance id, as it registers with it
    assert limits.registration_problem("node-17.cluster.example.internal", "0.1.0", endpoints, capabilities,
                                       "{}" * 5000, client._instance_id, HASH) is None
    client.close()
    from omni.metrics import BATCH_BUCKETS, BATCH_KEY, ENGINE_GAUGE, STEP_BUCKETS, STEP_KEY, Histogram

    extra = {k: 1.0 for k in ("steps", "step_s_total", "tensor_bytes_out", "tensor_bytes_in", "stalls",
                              "stall_s_total", "held_outputs")}
    for transport in ("shm", "tcp", "cuda_ipc", "nccl", "inline"):
        extra.update({f"tensor_bytes_out.{transport}": 1.0, f"tensor_bytes_in.{transport}": 1.0})
    extra.update(Histogram(STEP_BUCKETS).to_flat(STEP_KEY))
    extra.update(Histogram(BATCH_BUCKETS).to_flat(BATCH_KEY))
    extra.update({f"{ENGINE_GAUGE}progress_{i}": 1.0 for i in range(8)})
    assert len(extra) * 4 < limits.MAX_EXTRA_ENTRIES and limits.extra_problem(extra) is None


def test_an_oversize_heartbeat_extra_ends_the_stream_naming_it(master):
    server, stub = master
    reg = stub.Register(pb.RegisterRequest(role=pb.STAGE, stage_id=0, host="h", pid=1, config_hash=HASH))
    extra = {f"k{i}": 1.0 for i in range(limits.MAX_EXTRA_ENTRIES + 1)}
    call = stub.KeepAlive(iter([pb.Heartbeat(lease_id=reg.lease_id, replica_id=reg.replica_id, extra=extra)]))
    code, details = _refusal(lambda: list(call))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "heartbeat extra: 257 entries, at most 256" in details
    with MasterClient(server.address) as c:
        assert [r.extra for r in c.get_status().replicas] == [{}]


def _frontend(pid: int) -> RegisterInput:
    return RegisterInput(role=Role.FRONTEND, stage_id=-1, host="h", pid=pid, config_hash=HASH)


def test_the_registry_holds_a_bounded_number_of_entries_per_role():
    now = [0.0]
    reg = Registry(CFG, HASH, lease_ttl_s=1.0, clock=lambda: now[0], max_entries_per_role=2)
    a, _ = reg.register(_frontend(1))
    reg.register(_frontend(2))
    with pytest.raises(RegistryFull, match="2 FRONTEND entries"):
        reg.register(_frontend(3))
    stage, _ = reg.register(RegisterInput(role=Role.STAGE, stage_id=0, host="h", pid=9, config_hash=HASH))
    assert stage.replica_id == "s0r0"              # the other role counts apart
    for lease in (a.lease_id, stage.lease_id):
        reg.heartbeat(lease, None)
    now[0] = 0.5
    reg.heartbeat(a.lease_id, None)
    now[0] = 1.2                                   # fe1 (pid 2) DEAD; its slot is taken, the count stays
    reg.sweep()
    assert [r.state for r in reg.replicas() if r.role is Role.FRONTEND] == [ReplicaState.READY, ReplicaState.DEAD]
    assert reg.register(_frontend(3))[0].replica_id == "fe1"
    with pytest.raises(RegistryFull):
        reg.register(_frontend(4))


def test_a_full_registry_is_resource_exhausted_naming_the_limit(monkeypatch):
    monkeypatch.setattr(limits, "MAX_ENTRIES_PER_ROLE", 3)
    server = MasterServer(CFG, HASH, lease_ttl_s=5.0)
    server.start()
    try:
        with MasterClient(server.address) as c:
            for pid in range(3):
                c.register("FRONTEND", config_hash=HASH, host="h", pid=pid)
            with pytest.raises(OmniError, match="RESOURCE_EXHAUSTED: the master holds 3 FRONTEND entries") as e:
                c.register("FRONTEND", config_hash=HASH, host="h", pid=3)
            assert not isinstance(e.value, BadRequest)
    finally:
        server.stop(grace=0.2)


class _Err(grpc.RpcError):
    def __init__(self, code, details, md=()):
        self._c, self._d, self._md = code, details, md

    def code(self):
        return self._c

    def details(self):
        return self._d

    def trailing_metadata(self):
        return self._md


def test_only_a_full_kv_namespace_is_the_callers_error():
    """gRPC's own RESOURCE_EXHAUSTED (an answer over the receive limit) read as a KV-style 400."""
    local = _Err(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (6291686 vs. 4194304)")
    err = from_rpc_error(local, "m:1")
    assert not isinstance(err, BadRequest) and "RESOURCE_EXHAUSTED: Received message larger" in str(err)
    server = MasterServer(CFG, HASH)
    server.start()
    try:
        with MasterClient(server.address) as c:
            for i in range(64):
                c.kv_put(f"ns{i}", "k", b"v")
            with pytest.raises(BadRequest, match="64 namespaces"):
                c.kv_put("one-more", "k", b"v")

        async def via_asyncio():   # the frontends' client: its 400
            ac = AsyncMasterClient(server.address)
            try:
                with pytest.raises(BadRequest, match="64 namespaces"):
                    await ac.kv_put("one-more", "k", b"v")
            finally:
                await ac.close()

        asyncio.run(via_asyncio())
    finally:
        server.stop(grace=0.2)


@pytest.mark.parametrize("details, callers", [
    ("kv namespace 'voices' holds 1000 entries, the limit; delete some", True),
    ("kv namespace 'jobs' holds 67108800 bytes; 300 more would pass its limit of 67108864", True),
    ("the kv store holds 64 namespaces, the limit", True),
    ("the kv store holds 268435400 bytes; 300 more would pass its limit of 268435456; delete some", True),
    ("Received message larger than max (6291686 vs. 4194304)", False),
    ("the master holds 256 FRONTEND entries (live and DEAD), the limit", False),
])
def test_a_full_kv_namespace_from_an_older_master_is_still_the_callers_error(details, callers):
    """A master before e7ea975 marks no KvFull: in a rolling upgrade, a new frontend answered its full voices or
    jobs namespace with a 500. Its messages are those of omni/master/kv.py; gRPC's own stays internal."""
    err = from_rpc_error(_Err(grpc.StatusCode.RESOURCE_EXHAUSTED, details), "m:1")
    assert isinstance(err, BadRequest) is callers and details in str(err)


def test_every_kv_full_message_reads_as_the_callers_error_unmarked():
    """Each KvFull text of kv.py starts as from_rpc_error looks for (kept in step with it)."""
    store = KvStore(limits={"few": Limits(max_entries=1), "small": Limits(max_bytes=200)})
    texts = []
    for ns, key, value in (("few", "a", b""), ("few", "b", b""), ("small", "a", b"x" * 100),
                           *((f"ns{i}", "k", b"") for i in range(kv.MAX_NAMESPACES))):
        try:
            store.put(ns, key, value)
        except KvFull as e:
            texts.append(str(e))
    store._bytes["few"] = kv.MAX_TOTAL_BYTES        # the store's own byte limit
    try:
        store.put("small", "b", b"")
    except KvFull as e:
        texts.append(str(e))
    assert len(texts) == 4, texts
    for text in texts:
        assert isinstance(from_rpc_error(_Err(grpc.StatusCode.RESOURCE_EXHAUSTED, text), "m:1"), BadRequest), text


def test_an_unmarked_kv_full_through_the_client_is_a_400(monkeypatch):
    monkeypatch.setattr(server_mod, "KV_FULL", ("omni-older", "1"))     # as a master before e7ea975 answers
    server = MasterServer(CFG, HASH)
    server.start()
    try:
        with MasterClient(server.address) as c:
            for i in range(kv.MAX_NAMESPACES):
                c.kv_put(f"ns{i}", "k", b"v")
            with pytest.raises(BadRequest, match="the kv store holds 64 namespaces"):
                c.kv_put("one-more", "k", b"v")
    finally:
        server.stop(grace=0.2)


def test_a_status_over_grpcs_default_4_mib_reaches_the_clients(monkeypatch):
    """The clients' receive limit holds the largest status the caps allow (two roles' 256 entries of 8 KiB
    and their gauges, the config); gRPC's default 4 MiB did not."""
    assert 2 * limits.MAX_ENTRIES_PER_ROLE * 24 * 1024 + limits.MAX_CONFIG_BYTES < limits.MAX_RECEIVE_BYTES
    n = 540
    monkeypatch.setattr(limits, "MAX_ENTRIES_PER_ROLE", n)
    server = MasterServer(CFG, HASH)
    server.start()
    channel = grpc.insecure_channel(server.address)
    try:
        stub = pb_grpc.MasterStub(channel)
        caps = {f"c{i}": "x" * 1000 for i in range(8)}
        for pid in range(n):
            stub.Register(pb.RegisterRequest(role=pb.FRONTEND, host="h", pid=pid, config_hash=HASH, capabilities=caps))
        code, details = _refusal(lambda: stub.GetStatus(pb.GetStatusRequest()))   # gRPC's default limit
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details
        with MasterClient(server.address) as c:
            assert len(c.get_status().replicas) == n
            with c.watch(timeout_s=10) as w:
                assert len(next(iter(w)).replicas) == n
    finally:
        channel.close()
        server.stop(grace=0.2)
