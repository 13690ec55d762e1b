"""A stage's data plane on IPv6: the address it advertises and binds, its ZMQ channel (CURVE and the ZAP check
included) and the tcp and gloo tensor transports, over real sockets on ::1. Stages had refused an IPv6
--omni-replica-address and a master at another host's IPv6 address (ZMQ binds and dials IPv6 only with its
IPV6 option on, and an IPv6 host needs brackets in tcp://[HOST]:PORT)."""

from __future__ import annotations

import asyncio
import socket
import threading

import msgspec
import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from omni.engines.base import SamplingParams
from omni.errors import ConfigError
from omni.master.types import TopologyEvent
from omni.netaddr import bracketed, endpoint_host, host_port
from omni.orchestrator.executor import Orchestrator
from omni.orchestrator.topology import Topology
from omni.orchestrator.types import PipelineRequest
from omni.stage import main as stage_main
from omni.stage.curve import key_pair, secure_client
from omni.stage.main import check_advertise, check_replica_address, default_advertise_host
from omni.stage.worker import StageWorker
from omni.transport.base import TransportError
from omni.transport.factory import make_consumer, make_producer
from tests.unit.test_orchestrator_replay import CONFIG, info
from tests.unit.test_master_ipv6 import needs_ipv6
from tests.unit.test_stage_worker import CountEngine

TOKEN = "v6-token"




# ---- addresses

@pytest.mark.parametrize("host,want", [("::1", "[::1]"), ("[fd00::5]", "[fd00::5]"), ("10.0.0.1", "10.0.0.1"),
                                       ("node-1", "node-1"), ("fe80::1%eth0", "[fe80::1%eth0]")])
def test_an_ipv6_host_is_bracketed_once(host, want):
    assert bracketed(host) == want


@pytest.mark.parametrize("endpoint,want", [("tcp://[::1]:5000", "::1"), ("[fd00::5]:7", "fd00::5"),
                                           ("tcp://10.0.0.1:5000", "10.0.0.1"), ("node-1:80", "node-1")])
def test_the_host_of_an_endpoint(endpoint, want):
    assert endpoint_host(endpoint) == want


def test_an_ipv6_master_is_reached_from_the_ipv6_route(monkeypatch):
    """The stage advertised 127.0.0.1 (an IPv4 probe cannot reach an IPv6 master) or refused to start."""
    probed = []

    def route(host, family):
        probed.append((host, family))
        return {socket.AF_INET6: "fd00::2"}.get(family)

    monkeypatch.setattr(stage_main, "_route_source", route)
    for master in ("[fd00::1]:50051", "fd00::1:50051"):
        probed.clear()
        assert default_advertise_host(master) == "fd00::2"
        assert probed == [("fd00::1", socket.AF_INET6)]
    # a name: its IPv4 route first (as before), its IPv6 one where it has none (an IPv6-only cluster)
    probed.clear()
    assert default_advertise_host("master.svc:50051") == "fd00::2"
    assert probed == [("master.svc", socket.AF_INET), ("master.svc", socket.AF_INET6)]
    monkeypatch.setattr(stage_main, "_route_source", lambda host, family: {socket.AF_INET: "10.0.0.2"}.get(family))
    assert default_advertise_host("master.svc:50051") == "10.0.0.2"
    # no route at all: loopback of the master's family
    monkeypatch.setattr(stage_main, "_route_source", lambda host, family: None)
    assert default_advertise_host("[fd00::1]:50051") == "::1"
    assert default_advertise_host("10.0.0.1:50051") == "127.0.0.1"
    assert default_advertise_host("[::]:50051") == "127.0.0.1"   # a wildcard master: loopback, no probe


@needs_ipv6
def test_the_route_probe_answers_an_ipv6_address():
    assert stage_main._route_source("::1", socket.AF_INET6) == "::1"
    assert default_advertise_host("[::1]:50051") == "::1"
    assert stage_main._route_source("::1", socket.AF_INET) is None    # no IPv4 address to route to


def test_an_ipv6_replica_address_is_taken_with_the_same_checks():
    check_replica_address("fd00::5", TOKEN)
    check_replica_address("::1", None)                  # loopback: no token needed
    with pytest.raises(ConfigError, match="--omni-replica-address fd00::5 opens this stage's listeners"):
        check_replica_address("fd00::5", None)
    with pytest.raises(ConfigError, match="'\\[::\\]' is a wildcard"):
        check_replica_address("[::]", TOKEN)
    # bound and registered without brackets, as sockets take it
    assert check_advertise("[fd00::5]", "[fd00::1]:1", TOKEN) == "fd00::5"
    assert stage_main.replica_host("[fd00::5]", "[fd00::1]:1") == "fd00::5"


def test_a_picked_ipv6_address_beyond_loopback_needs_the_token(monkeypatch):
    monkeypatch.setattr(stage_main, "_route_source", lambda host, family: "fd00::2")
    with pytest.raises(ConfigError, match="fd00::2 \\(the local address of the route to the master"):
        check_advertise(None, "[fd00::1]:1", None)
    assert check_advertise(None, "[fd00::1]:1", TOKEN) == "fd00::2"
    monkeypatch.setattr(stage_main, "_route_source", lambda host, family: "::1")
    assert check_advertise(None, "[::1]:1", None) == "::1"


# ---- the stage channel

@pytest.fixture
def v6_worker():
    w = StageWorker(CONFIG.stage(0), CountEngine(), host="::1", token=TOKEN, replica_id="s0r0")
    t = threading.Thread(target=w.run, kwargs={"grace_s": 0.5}, daemon=True)
    t.start()
    yield w
    w.stop()
    t.join(10)
    assert not t.is_alive()


@needs_ipv6
def test_a_frontend_reaches_a_stage_over_ipv6(v6_worker):
    w = v6_worker
    assert w.endpoint.startswith("tcp://[::1]:"), w.endpoint
    replica = msgspec.structs.replace(info(w, "s0r0"), host="::1")

    async def go():
        topo = Topology()
        topo.apply(TopologyEvent("SNAPSHOT", [replica], 1))
        orch = Orchestrator(CONFIG, frontend_id="fe-v6", topology=topo, detokenize=lambda ids: "", token=TOKEN)
        req = PipelineRequest(request_id="r1", prompt_token_ids=[10], sampling=SamplingParams(max_tokens=3),
                              timeout_s=20)
        try:
            return [o async for o in orch.generate(req)]
        finally:
            await orch.close()

    outs = asyncio.run(asyncio.wait_for(go(), 30))
    assert [o.token_ids for o in outs if o.token_ids] == [[11], [12], [13]] and outs[-1].finished


@needs_ipv6
def test_the_stage_listens_on_ipv6_loopback_only(v6_worker):
    port = int(v6_worker.endpoint.rpartition(":")[2])
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0     # not on a wildcard: IPv4 loopback refuses


def _handshake(endpoint: str, setup) -> int:
    """The first handshake event a DEALER set up by `setup` sees on `endpoint`."""
    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.IPV6, 1)
    setup(d)
    mon = d.get_monitor_socket()
    mon.setsockopt(zmq.RCVTIMEO, 10_000)     # a deadline: recv raises zmq.Again past it
    try:
        d.connect(endpoint)
        while True:
            event = recv_monitor_message(mon)["event"]
            if event >= zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                return event
    finally:
        d.disable_monitor()
        mon.close()
        d.close()


@needs_ipv6
def test_curve_and_the_zap_check_hold_over_ipv6(v6_worker):
    def stranger(d):   # knows the server's key, but its own key pair is not the token's
        public, secret = zmq.curve_keypair()
        d.setsockopt(zmq.CURVE_SERVERKEY, key_pair(TOKEN, b"omni-stage-server")[0])
        d.setsockopt(zmq.CURVE_PUBLICKEY, public)
        d.setsockopt(zmq.CURVE_SECRETKEY, secret)

    assert _handshake(v6_worker.endpoint, stranger) == zmq.EVENT_HANDSHAKE_FAILED_AUTH   # the ZAP handler refused
    assert _handshake(v6_worker.endpoint, lambda d: secure_client(d, "wrong")) != zmq.EVENT_HANDSHAKE_SUCCEEDED
    assert _handshake(v6_worker.endpoint, lambda d: secure_client(d, TOKEN)) == zmq.EVENT_HANDSHAKE_SUCCEEDED


# ---- tensors

@needs_ipv6
@pytest.mark.parametrize("kind", ["tcp", "gloo"])
def test_tensors_travel_over_ipv6(kind):
    producer = make_producer(kind, host="::1", token=TOKEN)
    consumer = make_consumer(kind, token=TOKEN)
    stranger = make_consumer(kind, token="wrong")
    try:
        assert producer.endpoint.startswith("[::1]:"), producer.endpoint
        port = int(producer.endpoint.rpartition(":")[2])
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0   # bound on ::1 only
        x = torch.arange(300_000, dtype=torch.float32).reshape(3, -1)
        ref = producer.put(x)
        ref = msgspec.msgpack.decode(msgspec.msgpack.encode(ref), type=type(ref))   # as refs travel
        assert torch.equal(consumer.get(ref), x)
        with pytest.raises(TransportError, match="bad token"):
            stranger.get(ref)
    finally:
        stranger.close()
        consumer.close()
        producer.close()


def test_the_gloo_store_names_an_ipv6_peer_in_brackets():
    from omni.transport.store import RemoteStore

    with socket.socket(socket.AF_INET) as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TransportError, match=f"gloo store \\[::1\\]:{port}: handshake failed"):
        RemoteStore("::1", port, TOKEN, 1.0)
    assert host_port("::1", port) == f"[::1]:{port}"


@needs_ipv6
def test_the_http_listener_takes_a_bracketed_host():
    """`--host [::1]` as a URL writes it: bind() had read the brackets as a name ("Name or service not known")."""
    from omni.api.serve import bind_socket

    with bind_socket("[::1]", 0) as sock:
        assert sock.family == socket.AF_INET6 and sock.getsockname()[0] == "::1"


def test_loopback_addresses_of_either_family_are_one_host():
    """A master on ::1 has its stages advertise ::1, and a frontend on 127.0.0.1 advertises that: shared memory
    between them, not tcp."""
    from omni.transport.factory import choose_transport, same_host

    for a, b in (("127.0.0.1", "::1"), ("::1", "::ffff:127.0.0.1"), ("localhost", "127.0.0.2"), ("::1", "")):
        assert same_host(a, b) and choose_transport(a, b) == "shm", (a, b)
    assert not same_host("::1", "fd00::2") and not same_host("127.0.0.1", "10.0.0.5")
