"""A stage reads input tensors of another host off its loop thread (omni/stage/input_reads.py): a silent
tcp producer holds only the request that reads from it; an Abort during the read is honoured; the
pieces of one request reach the engine in the order they came."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from omni.config import StageConfig
from omni.engines.base import EngineRequest, SamplingParams
from omni.stage import messages as m
from omni.stage.input_reads import InputReads
from omni.transport.base import TensorRef, TransportError
from omni.transport.factory import MultiConsumer
from tests.unit.test_stage_worker import CountEngine, dealer, enc, hello, load_when, recv, running

READ_TIMEOUT_S = 3.0


class RecordingEngine(CountEngine):
    def __init__(self):
        super().__init__()
        self.added: list[tuple[str, list[int], tuple[str, ...]]] = []

    def add_request(self, r: EngineRequest) -> None:
        self.added.append((r.request_id, list(r.prompt_token_ids or []), tuple(sorted(r.tensors))))
        super().add_request(r)


class SilentProducer:
    """A tcp "producer" that accepts and never answers (a host that stopped); `closed` is set when the
    consumer gives up and closes its connection."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted, self.closed = threading.Event(), threading.Event()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        self._conns.append(conn)
        self.accepted.set()
        conn.settimeout(30)
        try:
            while conn.recv(4096):   # the consumer's hello never comes (it waits for our nonce)
                pass
        except OSError:
            pass
        self.closed.set()

    def ref(self, key: int = 1) -> TensorRef:
        return TensorRef(transport="tcp", endpoint=f"127.0.0.1:{self.port}", key=key, dtype="float32",
                         shape=(4,), nbytes=16, owner="r1")

    def close(self) -> None:
        self.sock.close()
        for c in self._conns:
            c.close()


class GatedConsumer:
    """tcp refs wait for `gate` (a read in progress), then yield a tensor of their key."""

    def __init__(self):
        self.gate = threading.Event()
        self.started = threading.Event()

    def get(self, ref: TensorRef) -> torch.Tensor:
        self.started.set()
        if not self.gate.wait(10):
            raise TransportError("gate never opened")
        return torch.full((1,), float(ref.key))

    def close(self) -> None:
        self.gate.set()


def _far_ref(key: int = 5) -> TensorRef:
    return TensorRef(transport="tcp", endpoint="10.0.0.9:1", key=key, dtype="float32", shape=(1,), nbytes=4)


def _run(consumer, engine):
    """A reading stage on a thread: next() starts it, next(gen, None) stops it."""
    return running(StageConfig(stage_id=1, engine="count", name="reader"), engine, consumer=consumer)


@pytest.fixture
def silent():
    p = SilentProducer()
    yield p
    p.close()


@pytest.fixture
def silent_stage(silent):
    gen = _run(MultiConsumer({"tcp": {"timeout": READ_TIMEOUT_S}}, token="secret"), RecordingEngine())
    w, engine = next(gen)
    s = dealer(w.endpoint)
    try:
        assert hello(s).ok
        yield w, engine, s, silent
    finally:
        s.close()
        next(gen, None)


def add(rid: str, prompt: int, tensors: dict | None = None, max_tokens: int = 1) -> bytes:
    return enc.encode(m.AddRequest(request_id=rid, prompt_token_ids=[prompt], tensors=tensors or {},
                                   sampling=SamplingParams(max_tokens=max_tokens)))


def test_a_silent_producer_holds_only_the_request_that_reads_from_it(silent_stage):
    w, engine, s, silent = silent_stage
    t0 = time.monotonic()
    s.send(add("r1", 10, {"x": silent.ref()}))
    s.send(add("r2", 20))
    s.send(enc.encode(m.Utility(7, "ping")))
    # Before: the loop sat in r1's hello for READ_TIMEOUT_S; r1's error came first, then r2 and the ping.
    first, second = recv(s), recv(s)
    assert time.monotonic() - t0 < READ_TIMEOUT_S - 1
    got = {type(first), type(second)}
    assert got == {m.Output, m.UtilityResult}, (first, second)
    out = first if isinstance(first, m.Output) else second
    assert out.request_id == "r2" and out.token_ids == [21] and out.finished
    load_when(w, lambda load: load["in_flight"] == 1)   # r1, waiting for its read
    err = recv(s)
    # The read's error is r1's, as it was when read inline: TransportError, kind internal.
    assert isinstance(err, m.RequestError) and err.request_id == "r1" and err.kind == "internal"
    assert err.message.startswith(f"TransportError: producer 127.0.0.1:{silent.port}: handshake failed"), err
    assert time.monotonic() - t0 >= READ_TIMEOUT_S - 0.5
    assert [a[0] for a in engine.added] == ["r2"]


def test_an_abort_during_the_read_is_honoured(silent_stage):
    w, engine, s, silent = silent_stage
    s.send(add("r1", 10, {"x": silent.ref()}))
    assert silent.accepted.wait(10)   # the read is running (one not started yet is simply cancelled)
    s.send(enc.encode(m.Abort(["r1"])))
    s.send(add("r2", 20))
    out = recv(s)
    assert out.request_id == "r2" and out.finished
    load_when(w, lambda load: load["in_flight"] == 0)
    assert silent.closed.wait(READ_TIMEOUT_S + 5)   # r1's read ended (timed out)
    s.send(add("r3", 30))   # its end went through the loop before r3's output comes
    out = recv(s)
    assert out.request_id == "r3"
    assert not s.poll(300)   # nothing of r1: no output, no error
    # Before: the abort waited behind r1's read and r1 was admitted (then aborted).
    assert [a[0] for a in engine.added] == ["r2", "r3"] and "r1" not in engine.aborted


@pytest.fixture
def gated():
    """A stage whose remote reads wait for `consumer.gate`, and a frontend socket said hello."""
    consumer = GatedConsumer()
    gen = _run(consumer, RecordingEngine())
    w, engine = next(gen)
    s = dealer(w.endpoint)
    try:
        assert hello(s).ok
        yield consumer, engine, w, s
    finally:
        consumer.gate.set()
        s.close()
        next(gen, None)   # stops it; fails if its loop did not end


def test_a_read_that_ends_after_its_abort_is_dropped(gated):
    consumer, engine, w, s = gated
    s.send(add("r1", 10, {"x": _far_ref()}))
    assert consumer.started.wait(10)
    s.send(enc.encode(m.Abort(["r1"])))
    s.send(add("r2", 20))
    # Before: the loop sat in r1's read until the gate's 10 s were up; r1's error came first.
    out = recv(s)
    assert out.request_id == "r2" and out.finished
    consumer.gate.set()   # r1's read succeeds now, after its abort
    s.send(add("r3", 30))
    assert recv(s).request_id == "r3"
    assert not s.poll(300)   # nothing of r1
    assert [a[0] for a in engine.added] == ["r2", "r3"]


def test_a_read_not_started_is_cancelled_by_its_abort():
    consumer = GatedConsumer()
    reads = InputReads(consumer, lambda: None, threads=1)
    try:
        assert reads.take(b"fe", m.AddRequest(request_id="r1", tensors={"x": _far_ref(1)}))
        assert consumer.started.wait(10)   # the only thread is in r1's read
        assert reads.take(b"fe", m.AddRequest(request_id="r2", tensors={"x": _far_ref(2)}))
        assert not reads.take(b"fe", m.AddRequest(request_id="r3"))   # nothing to read, nothing before it
        reads.abort("r2")
        consumer.gate.set()
        deadline = time.monotonic() + 10
        got = []
        while not got and time.monotonic() < deadline:
            got = reads.ready()
            time.sleep(0.01)
        assert [(g[1].request_id, float(g[2]["x"][0])) for g in got] == [("r1", 1.0)]
        assert not reads
    finally:
        consumer.gate.set()
        reads.close()


def test_a_stream_piece_behind_a_read_is_taken_while_draining(gated):
    consumer, engine, w, s = gated
    s.send(add("r1", 10, {"x": _far_ref()}, max_tokens=2))
    assert consumer.started.wait(10)
    assert w.command("DRAIN")[0]
    s.send(add("r1", 11, max_tokens=2))   # r1's next piece: r1 is no new request
    s.send(add("r2", 20))                  # a new one is refused
    err = recv(s)
    assert isinstance(err, m.RequestError) and err.request_id == "r2" and "draining" in err.message
    consumer.gate.set()
    assert [recv(s).request_id for _ in range(2)] == ["r1", "r1"]
    assert [a[:2] for a in engine.added] == [("r1", [10]), ("r1", [11])]


def test_a_later_piece_waits_for_an_earlier_one_still_being_read(gated):
    consumer, engine, w, s = gated
    s.send(add("r1", 10, {"x": _far_ref(5)}, max_tokens=3))
    assert consumer.started.wait(10)
    s.send(add("r1", 11, max_tokens=3))      # the stream's next piece: nothing to read, still waits
    s.send(add("r1/s2", 12, max_tokens=3))   # another part of the same request
    s.send(add("r9", 90))                    # another request goes by
    out = recv(s)
    assert out.request_id == "r9"
    assert [a[0] for a in engine.added] == ["r9"]
    consumer.gate.set()
    deadline = time.monotonic() + 10
    while len(engine.added) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.added[1:] == [("r1", [10], ("x",)), ("r1", [11], ()), ("r1/s2", [12], ())]


def test_a_request_still_waiting_for_its_read_at_stop_gets_unavailable(gated):
    consumer, engine, w, s = gated
    s.send(add("r1", 10, {"x": _far_ref(5)}))
    assert consumer.started.wait(10)
    w.stop()
    err = recv(s)
    assert isinstance(err, m.RequestError) and err.request_id == "r1" and err.kind == "unavailable"
    assert "shutting down" in err.message and engine.added == []   # the loop's end: gated's teardown


def test_sleep_is_refused_while_a_request_waits_for_its_read(gated):
    """The read once held the loop, so SLEEP came after the request was in the engine, which refuses to sleep
    with work open; off the loop, SLEEP slipped in and the request was refused 'asleep' when its read ended."""
    consumer, engine, w, s = gated
    s.send(add("r1", 10, {"x": _far_ref(5)}))
    assert consumer.started.wait(10)
    ok, message = w.command("SLEEP")
    assert not ok and "waiting for their input" in message and not engine.is_sleeping(), message
    consumer.gate.set()
    out = recv(s)
    assert out.request_id == "r1" and not isinstance(out, m.RequestError), out


def test_sleep_with_mode_abort_ends_a_request_waiting_for_its_read(gated):
    """vLLM's mode=abort: the request whose read is running gets its 503 now, and is never admitted."""
    consumer, engine, w, s = gated
    s.send(add("r1", 10, {"x": _far_ref(5)}))
    assert consumer.started.wait(10)
    assert w.command("SLEEP", {"level": 1, "mode": "abort"}) == (True, "sleeping")
    err = recv(s)
    assert isinstance(err, m.RequestError) and err.request_id == "r1" and err.kind == "unavailable"
    assert "mode=abort" in err.message and engine.is_sleeping()
    consumer.gate.set()             # the read ends: nothing of r1 is admitted
    assert w.command("WAKE_UP") == (True, "awake")
    s.send(add("r2", 20))
    out = recv(s)
    assert out.request_id == "r2" and engine.added and [a[0] for a in engine.added] == ["r2"]
