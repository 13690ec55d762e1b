"""The stage channel over LocalChannel (omni/stage/local_link.py, omni/orchestrator/local_channel.py):
framing of big messages, the stage's queue limit, the frontend channel's semantics, and a real
StageWorker served through an Orchestrator on it (and on ZMQ when OMNI_STAGE_CHANNEL=zmq)."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest

from omni.config import StageConfig
from omni.engines.base import SamplingParams
from omni.errors import OmniError, Unavailable
from omni.master.types import ReplicaInfo, TopologyEvent
from omni.orchestrator.executor import Orchestrator
from omni.orchestrator.local_channel import LocalStageChannel
from omni.orchestrator.topology import Topology
from omni.orchestrator.types import PipelineRequest
from omni.stage import messages as m
from omni.stage.local_link import FramedLink, connect_stage, local_enabled, local_endpoint, same_host_name
from omni.stage.worker import StageWorker
from omni.transport.base import TransportError
from omni.transport.local import LocalChannel, LocalListener
from tests.unit.test_orchestrator_replay import CONFIG
from tests.unit.test_stage_worker import CountEngine, load_when

REPO = Path(__file__).resolve().parents[2]
DEADLINE = 30.0


def pair(**kw) -> tuple[FramedLink, FramedLink]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    return FramedLink(LocalChannel(a), **kw), FramedLink(LocalChannel(b))


def pump(tx: FramedLink, rx: FramedLink, count: int) -> list[bytes]:
    """Flush `tx` and read `rx` until `count` messages arrived (one thread: both non-blocking)."""
    got: list[bytes] = []
    deadline = time.monotonic() + DEADLINE
    while len(got) < count:
        assert time.monotonic() < deadline, f"only {len(got)} of {count} messages arrived"
        tx.flush()
        select.select([rx], [tx] if tx.pending else [], [], 1.0)
        msgs, eof = rx.read()
        assert not eof
        got.extend(bytes(x) for x in msgs)
    return got


def test_messages_of_any_size_arrive_whole_and_in_order():
    tx, rx = pair()
    sizes = [1, 100, 65534, 65535, 65536, 200_000, 5 << 20, 3]
    msgs = [bytes([i + 1]) * n for i, n in enumerate(sizes)]
    for msg in msgs:
        assert tx.send(msg)       # without a limit, what the socket cannot take now is queued
    assert pump(tx, rx, len(msgs)) == msgs
    assert not tx.pending
    tx.close()
    assert rx.read() == ([], True)


def test_size_cap_on_both_ends():
    tx, rx = pair(max_bytes=100_000)
    with pytest.raises(ValueError, match="exceeds the channel's cap"):
        tx.send(b"x" * 100_001)
    small_rx = FramedLink(rx.ch, max_bytes=70_000)    # a sender that ignores the cap is cut off
    tx.send(b"y" * 90_000)
    tx.flush()
    select.select([small_rx], [], [], DEADLINE)
    with pytest.raises(TransportError, match="over 70000 bytes"):
        small_rx.read()


def test_stage_side_queue_limit_says_full_then_drains():
    tx, rx = pair(max_queued=4)
    sent = 0
    while tx.send(b"z" * 60_000):       # the socket buffer fills, then four packets queue
        sent += 1
        assert sent < 10_000, "the queue limit never applied"
    assert tx.pending
    assert pump(tx, rx, sent) == [b"z" * 60_000] * sent
    assert tx.send(b"again") and pump(tx, rx, 1) == [b"again"]


def test_endpoint_names_this_host_and_the_switch(monkeypatch):
    ep = local_endpoint("omni-local-x")
    assert same_host_name(ep) == "omni-local-x"
    assert same_host_name("local://another-host/omni-local-x") is None
    assert same_host_name("tcp://127.0.0.1:5555") is None
    assert connect_stage("local://another-host/x", "t") is None
    assert connect_stage(local_endpoint("omni-local-nobody-listens"), "t") is None
    monkeypatch.setenv("OMNI_STAGE_CHANNEL", "zmq")
    assert local_enabled() is False
    monkeypatch.setenv("OMNI_STAGE_CHANNEL", "carrier-pigeon")
    with pytest.raises(OmniError, match="OMNI_STAGE_CHANNEL='carrier-pigeon'"):
        local_enabled()
    monkeypatch.delenv("OMNI_STAGE_CHANNEL")
    assert local_enabled() is True


# ---- the frontend's channel against a silent stage end


def test_frontend_channel_calls_time_out_close_fails_calls_and_eof_is_reported():
    async def go():
        listener = LocalListener(token="t")
        link = connect_stage(local_endpoint(listener.name), "t")
        assert link is not None
        stage_end = await asyncio.to_thread(listener.accept, DEADLINE)
        lost = asyncio.get_running_loop().create_future()
        ch = LocalStageChannel(link, frontend_id="fe", replica_id="s0r0", stage_id=0, endpoint="x", token="t",
                               on_message=lambda c, msg: None, on_lost=lambda c, why: lost.set_result(why))
        with pytest.raises(asyncio.TimeoutError):
            await ch.call("ping", timeout=0.2)      # the stage end never answers
        assert stage_end.recv(timeout=DEADLINE)[1:] == ch._enc.encode(m.Utility(1, "ping", {}))
        pending = asyncio.ensure_future(ch.call("ping", timeout=DEADLINE))
        got = await asyncio.to_thread(stage_end.recv, DEADLINE)     # the second call was posted
        assert got[1:] == ch._enc.encode(m.Utility(2, "ping", {}))
        stage_end.close()                             # the stage process went away
        assert await asyncio.wait_for(lost, DEADLINE) == "the replica closed its channel"
        with pytest.raises(Unavailable, match="went away"):
            await pending
        with pytest.raises(Unavailable, match="channel closed"):
            ch.post(object())
        listener.close()

    asyncio.run(go())


# ---- a real worker behind an Orchestrator


def info(w: StageWorker, replica_id: str, state: str = "READY") -> ReplicaInfo:
    endpoints = {"channel": w.endpoint, **({"local": w.local_endpoint} if w.local_endpoint else {})}
    return ReplicaInfo(stage_id=0, replica_id=replica_id, replica_index=int(replica_id[-1]), role="STAGE",
                       host="127.0.0.1", pid=1, endpoints=endpoints, state=state, queue_len=0, in_flight=0,
                       requests_total=0, cpu_seconds=0.0, is_sleeping=False, draining=False, extra={},
                       heartbeat_age_s=0.0, version="test", capabilities={})


@pytest.fixture
def served():
    """start(engine) -> a StageWorker with a local listener, run on a thread, stopped at teardown."""
    started = []

    def start(engine, replica_id="s0r0") -> StageWorker:
        w = StageWorker(StageConfig(stage_id=0, engine="count", name="counter"), engine, token="secret",
                        replica_id=replica_id, local_channel=True)
        t = threading.Thread(target=w.run, kwargs={"grace_s": 0.5}, daemon=True)
        t.start()
        started.append((w, t))
        return w
    yield start
    for w, t in started:
        w.stop()
        t.join(10)
        assert not t.is_alive()


async def generate(orch: Orchestrator, rid: str, prompt: list[int], max_tokens: int = 3) -> list[list[int]]:
    req = PipelineRequest(request_id=rid, prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=max_tokens),
                          timeout_s=DEADLINE)
    return [o.token_ids async for o in orch.generate(req) if o.token_ids]


@pytest.mark.parametrize("mode", ["local", "zmq"])
def test_requests_are_served_over_the_chosen_carrier(served, monkeypatch, mode):
    monkeypatch.setenv("OMNI_STAGE_CHANNEL", mode)
    w = served(CountEngine())
    assert w.local_endpoint.startswith("local://")

    async def go():
        topo = Topology()
        topo.apply(TopologyEvent("SNAPSHOT", [info(w, "s0r0")], 1))
        orch = Orchestrator(CONFIG, frontend_id="fe-test", topology=topo, detokenize=lambda ids: "",
                            token="secret")
        try:
            assert await generate(orch, "r1", [10]) == [[11], [12], [13]]
            # A prompt of 300k token ids is a ~1.5 MB AddRequest: it crosses in pieces.
            assert await generate(orch, "r2", list(range(300_000)) + [7], 2) == [[8], [9]]
            ch = orch._channels["s0r0"]
            assert (await ch.welcomed).ok
            assert await ch.call("ping") == "pong"
            return ch.kind, orch.metrics_text()
        finally:
            await orch.close()

    kind, metrics = asyncio.run(go())
    assert kind == mode
    assert f'omni_stage_channels{{frontend="fe-test",kind="{mode}"}} 1' in metrics
    # welcome, 5 outputs, the ping's result
    counts = load_when(w, lambda load: load["extra"].get(f"channel_msgs_out.{mode}", 0) >= 7)["extra"]
    other = "zmq" if mode == "local" else "local"
    assert counts.get(f"channel_msgs_out.{other}", 0) == 0


def test_a_wrong_token_never_reaches_the_worker(served):
    w = served(CountEngine())
    assert connect_stage(w.local_endpoint, "not-the-token") is None
    assert connect_stage(w.local_endpoint, "secret") is not None


STALL_CHILD = """
import sys, threading
from omni.config import StageConfig
from omni.stage.worker import StageWorker
from tests.unit.test_orchestrator_replay import StallEngine
engine = StallEngine(0)
w = StageWorker(StageConfig(stage_id=0, engine="count"), engine, token="secret", replica_id="s0r0",
                local_channel=True)
print(w.endpoint, w.local_endpoint, flush=True)
threading.Thread(target=lambda: (engine.added.wait(), print("added", flush=True)), daemon=True).start()
w.run()
"""


def test_a_replica_that_dies_is_noticed_by_its_channel_and_the_request_replayed(served):
    """No topology change is fed: the closed channel alone moves the request to the other replica."""
    child = subprocess.Popen([sys.executable, "-c", STALL_CHILD], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO)
    try:
        ready = select.select([child.stdout], [], [], DEADLINE)[0]
        assert ready, "the stage child never printed its endpoints"
        endpoint, local = child.stdout.readline().split()
        other = served(CountEngine(), "s0r1")

        async def go():
            dying = info(other, "s0r0")
            dying = msgspec.structs.replace(dying, endpoints={"channel": endpoint, "local": local})
            topo = Topology()
            topo.apply(TopologyEvent("SNAPSHOT", [dying], 1))
            orch = Orchestrator(CONFIG, frontend_id="fe-test", topology=topo, detokenize=lambda ids: "",
                                token="secret")
            task = asyncio.create_task(generate(orch, "r1", [10]))
            line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), DEADLINE)
            assert line.strip() == "added"
            assert orch._channels["s0r0"].kind == "local"
            topo.replicas["s0r1"] = info(other, "s0r1")    # the other replica, without an event
            child.send_signal(signal.SIGKILL)
            try:
                outs = await asyncio.wait_for(task, DEADLINE)
                # This frontend sees it SUSPECT until the master speaks: the next request goes elsewhere.
                assert topo.replicas["s0r0"].state == "SUSPECT"
                assert await asyncio.wait_for(generate(orch, "r2", [20], 1), DEADLINE) == [[21]]
                return outs, orch.metrics.replays
            finally:
                await orch.close()

        outs, replays = asyncio.run(go())
        assert outs == [[11], [12], [13]]
        assert replays == {0: 1}
    finally:
        child.kill()
        child.wait(DEADLINE)


def test_a_frontend_that_does_not_read_gets_its_output_held_and_the_loop_serves_others(served):
    """Output for a frontend that stops reading fills its socket and then the link's queue; the
    worker holds the rest (stops stepping) instead of blocking, answers another frontend meanwhile,
    and delivers everything in order once the slow one reads."""
    w = served(CountEngine())
    enc, dec = m.Codec(m.FromStage), m.frontend_codec()
    slow, other = connect_stage(w.local_endpoint, "secret"), connect_stage(w.local_endpoint, "secret")
    for link in (slow, other):
        assert link.send(enc.encode(m.Hello("fe", "secret")))
        assert isinstance(dec.decode(pump(link, link, 1)[0]), m.Welcome)
    n = 3000
    assert slow.send(enc.encode(m.AddRequest(request_id="r1", prompt_token_ids=[0],
                                             sampling=SamplingParams(max_tokens=n))))
    load_when(w, lambda load: load["extra"]["held_outputs"] > 0, DEADLINE)
    other.send(enc.encode(m.Utility(1, "ping", {})))      # the other frontend is still answered
    assert dec.decode(pump(other, other, 1)[0]).result == "pong"
    assert w.stats.stalls >= 1
    tokens = []
    while len(tokens) < n:
        msgs = pump(slow, slow, 1)
        tokens.extend(t for raw in msgs for t in dec.decode(raw).token_ids)
    assert tokens == list(range(1, n + 1))


def test_a_frontend_that_closes_its_channel_has_its_requests_aborted(served):
    from tests.unit.test_orchestrator_replay import StallEngine

    engine = StallEngine(0)
    w = served(engine)
    enc, dec = m.Codec(m.FromStage), m.frontend_codec()
    leaving, other = connect_stage(w.local_endpoint, "secret"), connect_stage(w.local_endpoint, "secret")
    for link in (leaving, other):
        assert link.send(enc.encode(m.Hello("fe", "secret")))
        assert isinstance(dec.decode(pump(link, link, 1)[0]), m.Welcome)
    leaving.send(enc.encode(m.AddRequest(request_id="r1", prompt_token_ids=[0], sampling=SamplingParams(max_tokens=5))))
    assert engine.added.wait(DEADLINE)
    load_when(w, lambda load: load["in_flight"] == 1)
    leaving.close()               # the frontend process went away
    for i in (1, 2):              # two round trips: the loop went past the close
        other.send(enc.encode(m.Utility(i, "ping", {})))
        assert dec.decode(pump(other, other, 1)[0]).result == "pong"
    assert engine.aborted == ["r1"]
    load_when(w, lambda load: load["in_flight"] == 0)


LISTENER_CHILD = """
import sys
from omni.transport.local import LocalListener
listener = LocalListener(token="secret")
print(listener.name, flush=True)
sys.stdin.read()
"""


def test_a_stopped_stage_does_not_hold_the_frontends_loop_and_zmq_serves_it(served):
    """The local connect (connect + hello) of a stage that is alive but stopped (SIGSTOP: its
    listener takes the connection, nobody answers) runs on the loop: a timer due meanwhile fires on
    time, and once the connect's deadline passes ZMQ carries what was posted, Hello first."""
    child = subprocess.Popen([sys.executable, "-c", LISTENER_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO)
    try:
        assert select.select([child.stdout], [], [], DEADLINE)[0], "the listener child never printed its name"
        name = child.stdout.readline().strip()
        child.send_signal(signal.SIGSTOP)
        w = served(CountEngine())

        async def go():
            stopped = msgspec.structs.replace(info(w, "s0r0"), endpoints={"channel": w.endpoint,
                                                                          "local": local_endpoint(name)})
            topo = Topology()
            topo.apply(TopologyEvent("SNAPSHOT", [stopped], 1))
            orch = Orchestrator(CONFIG, frontend_id="fe-test", topology=topo, detokenize=lambda ids: "",
                                token="secret")
            loop = asyncio.get_running_loop()
            try:
                t0 = time.monotonic()
                probe = loop.create_future()
                loop.call_later(0.05, lambda: probe.set_result(time.monotonic()))
                task = asyncio.create_task(generate(orch, "r1", [10]))
                fired = await asyncio.wait_for(probe, DEADLINE)
                assert not task.done()
                outs = await asyncio.wait_for(task, DEADLINE)
                ch = orch._channels["s0r0"]
                assert (await ch.welcomed).ok and await ch.call("ping") == "pong"
                return fired - t0, outs, ch.kind
            finally:
                await orch.close()

        late, outs, kind = asyncio.run(go())
        assert late < 0.5, f"a 50 ms timer fired after {late:.2f} s: the connect held the loop"
        assert outs == [[11], [12], [13]] and kind == "zmq"
    finally:
        child.kill()
        child.wait(DEADLINE)
