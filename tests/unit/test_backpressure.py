"""Backpressure: a stage whose consumers do not free tensors (or read results) stops
producing instead of failing requests or growing memory; past stall_timeout_s the
request at the head fails with a message that says why."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import torch
import zmq

from omni.config import StageConfig
from omni.engines.base import Engine, EngineOutput, EngineRequest, SamplingParams
from omni.stage import messages as m
from omni.stage.worker import StageWorker
from omni.transport.base import ProducerFull, TransportError
from omni.transport.shm import HEADER, ShmConsumer, ShmProducer
from omni.transport.tcp import TcpProducer
from tests.unit.test_stage_worker import load_when

PIECE = 1024   # bytes per output tensor
ARENA = 4 * (HEADER + PIECE)   # room for four pieces


class PieceEngine(Engine):
    """One float32 tensor of PIECE bytes per step per request, its value the step index."""

    def __init__(self):
        self.reqs: dict[str, list[int]] = {}
        self.steps = 0

    def add_request(self, r: EngineRequest) -> None:
        self.reqs[r.request_id] = [0, r.sampling.max_tokens]

    def abort(self, rid: str) -> None:
        self.reqs.pop(rid, None)

    def step(self) -> list[EngineOutput]:
        self.steps += 1
        outs = []
        for rid, st in list(self.reqs.items()):
            st[0] += 1
            done = st[0] == st[1]
            outs.append(EngineOutput(request_id=rid, finished=done,
                                     tensors={"x": torch.full((PIECE // 4,), float(st[0]))}))
            if done:
                del self.reqs[rid]
        return outs

    def has_unfinished(self) -> bool:
        return bool(self.reqs)


def start(stall_timeout_s: float = 30.0):
    producers = []

    def make(kind):
        p = ShmProducer(arena_bytes=ARENA, max_segments=1)
        producers.append(p)
        return p

    engine = PieceEngine()
    w = StageWorker(StageConfig(stage_id=1, engine="piece", name="talker"), engine,
                    make_producer=make, replica_id="s1r0", stall_timeout_s=stall_timeout_s)
    t = threading.Thread(target=w.run, kwargs={"grace_s": 1.0}, daemon=True)
    t.start()
    return w, engine, producers, t


@pytest.fixture
def frontend():
    socks = []

    def connect(endpoint):
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 10_000)   # every wait has a deadline
        s.connect(endpoint)
        socks.append(s)
        return s
    yield connect
    for s in socks:
        s.close()


enc = msgspec.msgpack.Encoder()
dec = msgspec.msgpack.Decoder(m.FromStage)


def add(s, rid, n):
    s.send(enc.encode(m.AddRequest(request_id=rid, prompt_token_ids=[1], out_transport="shm",
                                   sampling=SamplingParams(max_tokens=n))))


def test_full_arena_pauses_the_stage_until_consumers_free(frontend):
    w, engine, producers, t = start()
    try:
        s = frontend(w.endpoint)
        add(s, "r", 20)
        got = [dec.decode(s.recv()) for _ in range(4)]       # the arena holds four
        assert all(isinstance(o, m.Output) for o in got)
        # The fifth piece does not fit: the stage holds it and stops stepping.
        deadline = time.monotonic() + 10
        while True:
            s.send(enc.encode(m.Utility(1, "stats")))
            stats = dec.decode(s.recv())
            assert isinstance(stats, m.UtilityResult)
            if stats.result["held_outputs"] == 1 or time.monotonic() > deadline:
                break
        assert stats.result["held_outputs"] == 1 and stats.result["stalls"] == 1
        assert producers[0].bytes_in_use() <= ARENA
        # Free one piece at a time: each frees room for exactly the next one, in order.
        reader = ShmConsumer()
        while not got[-1].finished:
            oldest = got[len(got) - 4].tensors["x"]
            assert reader.get(oldest)[0].item() == len(got) - 3   # the step that made it
            s.send(enc.encode(m.FreeTensors([oldest.key], "shm")))
            out = dec.decode(s.recv())
            assert isinstance(out, m.Output), out
            got.append(out)
            assert producers[0].bytes_in_use() <= ARENA
            assert engine.steps <= len(got) + 1    # at most one piece made ahead of its room
        reader.close()
        assert len(got) == 20 and got[-1].finished
        load = load_when(w, lambda load: load["extra"]["held_outputs"] == 0 and load["extra"]["stalls"] >= 1)["extra"]
        assert load["stall_s_total"] > 0
    finally:
        w.stop()
        t.join(10)
    assert not t.is_alive()


def test_a_stall_past_the_timeout_fails_that_request_and_the_stage_lives(frontend):
    w, engine, producers, t = start(stall_timeout_s=0.3)
    try:
        s = frontend(w.endpoint)
        add(s, "stuck", 50)
        outs = [dec.decode(s.recv()) for _ in range(5)]
        assert [type(o) for o in outs[:4]] == [m.Output] * 4
        err = outs[4]
        assert isinstance(err, m.RequestError) and err.request_id == "stuck"
        assert "stall_timeout_s" in err.message and "stage 1 (talker)" in err.message
        assert "stuck" not in engine.reqs
        # Its tensors were freed with it (just after the error went out: a frontend reading one of them
        # then most likely has the stage's error first); a new request flows.
        deadline = time.monotonic() + 5
        while producers[0].bytes_in_use() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert producers[0].bytes_in_use() == 0
        add(s, "next", 2)
        outs = [dec.decode(s.recv()) for _ in range(2)]
        assert [o.request_id for o in outs] == ["next", "next"] and outs[-1].finished
    finally:
        w.stop()
        t.join(10)


def test_shm_and_tcp_producers_say_full_rather_than_grow():
    shm = ShmProducer(arena_bytes=ARENA, max_segments=1)
    tcp = TcpProducer(max_bytes_held=4 * PIECE)
    try:
        for p in (shm, tcp):
            refs = [p.put(torch.zeros(PIECE // 4)) for _ in range(4)]
            with pytest.raises(ProducerFull, match="must ack"):
                p.put(torch.zeros(PIECE // 4))
            p.free([refs[0].key])
            p.put(torch.zeros(PIECE // 4))
        # One tensor larger than the whole budget can never fit: a plain error, not "full".
        with pytest.raises(TransportError) as e:
            tcp.free_owner("")
            tcp.put(torch.zeros(PIECE * 2))
        assert not isinstance(e.value, ProducerFull) and "max_bytes_held" in str(e.value)
    finally:
        shm.close()
        tcp.close()
