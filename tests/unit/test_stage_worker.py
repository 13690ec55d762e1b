"""StageWorker over a real ZMQ socket, with an in-memory engine."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from omni.config import StageConfig
from omni.engines.base import Engine, EngineError, EngineOutput, EngineRequest, SamplingParams
from omni.stage import messages as m
from omni.stage.worker import StageWorker


class CountEngine(Engine):
    """Emits prompt[-1]+1, +2, ... one token per step, max_tokens of them."""

    def __init__(self):
        self.reqs: dict[str, list] = {}
        self.aborted: list[str] = []
        self.sleeping = False

    def add_request(self, r: EngineRequest) -> None:
        if not r.prompt_token_ids:
            raise EngineError("empty prompt")
        self.reqs[r.request_id] = [r.prompt_token_ids[-1], r.sampling.max_tokens]

    def abort(self, rid: str) -> None:
        if self.reqs.pop(rid, None) is not None:
            self.aborted.append(rid)

    def step(self) -> list[EngineOutput]:
        outs = []
        for rid, st in list(self.reqs.items()):
            st[0] += 1
            st[1] -= 1
            done = st[1] == 0
            outs.append(EngineOutput(request_id=rid, token_ids=[st[0]], finished=done,
                                     finish_reason="length" if done else None))
            if done:
                del self.reqs[rid]
        return outs

    def has_unfinished(self) -> bool:
        return bool(self.reqs)

    def can_sleep(self) -> bool:
        return True

    def sleep(self, level: int = 1) -> None:
        self.sleeping = True

    def wake_up(self) -> None:
        self.sleeping = False

    def is_sleeping(self) -> bool:
        return self.sleeping


def running(stage: StageConfig, engine: Engine, **kw):
    """A worker running on a thread (`kw`: StageWorker's, e.g. consumer); stopped (by a deadline) when the
    test is done."""
    w = StageWorker(stage, engine, token="secret", replica_id=f"s{stage.stage_id}r0", **kw)
    t = threading.Thread(target=w.run, kwargs={"grace_s": 1.0}, daemon=True)
    t.start()
    try:
        yield w, engine
    finally:
        w.stop()
        t.join(10)
    assert not t.is_alive()


def load_when(w: StageWorker, pred, timeout: float = 10.0) -> dict:
    """The load the keep-alive sends (taken on the loop thread: w.load() is that thread's only) once `pred`
    holds of it; at most 0.05 s old, and taken after each command."""
    deadline = time.monotonic() + timeout
    while not pred(load := w.load_snapshot.read()):
        assert time.monotonic() < deadline, f"the load never settled: {load}"
        time.sleep(0.01)
    return load


@pytest.fixture
def worker():
    yield from running(StageConfig(stage_id=0, engine="count", name="counter"), CountEngine())


def dealer(endpoint: str, ident: bytes = b"fe-test", token: str = "secret"):
    from omni.stage.curve import secure_client

    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, ident)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10_000)   # every wait has a deadline
    secure_client(s, token)
    s.connect(endpoint)
    return s


enc = msgspec.msgpack.Encoder()
dec = msgspec.msgpack.Decoder(m.FromStage)


def recv(s):
    return dec.decode(s.recv())


def hello(s, token="secret"):
    s.send(enc.encode(m.Hello("fe-test", token)))
    return recv(s)


def test_request_streams_outputs_back_to_its_frontend(worker):
    w, _ = worker
    s = dealer(w.endpoint)
    assert hello(s).ok
    s.send(enc.encode(m.AddRequest(request_id="r1", prompt_token_ids=[10],
                                   sampling=SamplingParams(max_tokens=3))))
    outs = [recv(s) for _ in range(3)]
    assert [o.token_ids for o in outs] == [[11], [12], [13]]
    assert [o.finished for o in outs] == [False, False, True]
    assert outs[0].queue_s is not None and outs[0].queue_s >= 0
    load_when(w, lambda load: load["requests_total"] == 1 and load["in_flight"] == 0)
    s.close()


def test_bad_token_is_refused_and_ignored(worker):
    w, engine = worker
    # CURVE keys from the wrong token: the handshake fails, ZMQ delivers nothing either way.
    s = dealer(w.endpoint, b"intruder", token="wrong")
    s.send(enc.encode(m.Hello("intruder", "secret")))
    s.send(enc.encode(m.AddRequest(request_id="x", prompt_token_ids=[1])))
    s.send(enc.encode(m.Utility(1, "ping")))
    # Right keys but the wrong token in Hello: refused by the worker too.
    half = dealer(w.endpoint, b"half")
    welcome = hello(half, token="wrong")
    assert not welcome.ok and "token" in welcome.error
    # Nothing comes back for an unauthenticated peer; an authenticated one still works.
    assert not s.poll(500)
    good = dealer(w.endpoint)
    assert hello(good).ok
    good.send(enc.encode(m.Utility(2, "ping")))
    res = recv(good)
    assert res.call_id == 2 and res.result == "pong"
    assert "x" not in engine.reqs
    s.close()
    half.close()
    good.close()


def test_garbage_and_bad_requests_get_errors_and_the_worker_lives(worker):
    w, _ = worker
    s = dealer(w.endpoint)
    assert hello(s).ok
    s.send(b"\xff\x00garbage")                          # undecodable: dropped with a warning
    s.send(enc.encode({"type": "nope"}))               # unknown tag: dropped
    s.send(enc.encode(m.AddRequest(request_id="bad", prompt_token_ids=[])))
    err = recv(s)
    assert isinstance(err, m.RequestError) and err.request_id == "bad" and "empty prompt" in err.message
    assert err.stage_id == 0 and err.replica_id == "s0r0"
    from omni.transport.base import TensorRef
    ref = TensorRef(transport="shm", endpoint="nowhere", key=1, dtype="float32", shape=(2,), nbytes=8)
    s.send(enc.encode(m.AddRequest(request_id="t", prompt_token_ids=[1], tensors={"x": ref})))
    err = recv(s)
    assert isinstance(err, m.RequestError) and err.request_id == "t"
    s.send(enc.encode(m.Utility(5, "no_such_method")))
    res = recv(s)
    assert not res.ok and "no_such_method" in res.error
    s.send(enc.encode(m.AddRequest(request_id="ok", prompt_token_ids=[1], sampling=SamplingParams(max_tokens=1))))
    assert recv(s).finished
    s.close()


def test_abort_stops_a_request(worker):
    w, engine = worker
    s = dealer(w.endpoint)
    assert hello(s).ok
    s.send(enc.encode(m.AddRequest(request_id="long", prompt_token_ids=[0],
                                   sampling=SamplingParams(max_tokens=10_000_000))))
    first = recv(s)
    assert first.request_id == "long"
    s.send(enc.encode(m.Abort(["long"])))
    s.send(enc.encode(m.Utility(9, "ping")))
    while True:   # outputs already in flight may precede the ping's answer
        msg = recv(s)
        if isinstance(msg, m.UtilityResult):
            break
    assert "long" in engine.aborted
    load_when(w, lambda load: load["in_flight"] == 0)
    s.close()


def test_commands_sleep_wake_and_drain(worker):
    w, engine = worker
    assert w.command("SLEEP", {"level": 1}) == (True, "sleeping")
    assert engine.sleeping and w.load_snapshot.read()["is_sleeping"]
    assert w.command("WAKE_UP") == (True, "awake")
    assert not engine.sleeping
    ok, msg = w.command("BOGUS")
    assert not ok and "BOGUS" in msg
    assert w.command("DRAIN") == (True, "draining")
    s = dealer(w.endpoint)
    assert hello(s).ok
    s.send(enc.encode(m.AddRequest(request_id="late", prompt_token_ids=[1])))
    err = recv(s)
    assert isinstance(err, m.RequestError) and "draining" in err.message
    assert "omni undrain --replica s0r0" in err.message        # says how to undo it
    assert w.command("UNDRAIN") == (True, "serving")
    s.send(enc.encode(m.AddRequest(request_id="back", prompt_token_ids=[1])))
    assert not isinstance(recv(s), m.RequestError)
    # Asleep: a request gets an error that says so and how to wake it, not an engine failure.
    assert w.command("SLEEP", {"level": 1}) == (True, "sleeping")
    s.send(enc.encode(m.AddRequest(request_id="asleep", prompt_token_ids=[1])))
    err = recv(s)
    while not isinstance(err, m.RequestError):   # the tail of "back"
        err = recv(s)
    assert err.request_id == "asleep" and "is asleep" in err.message and "omni wakeup --stage 0" in err.message
    s.close()


class SleeplessEngine(CountEngine):
    """An engine that cannot sleep: the base Engine's sleep methods."""

    can_sleep, sleep, wake_up, is_sleeping = Engine.can_sleep, Engine.sleep, Engine.wake_up, Engine.is_sleeping


@pytest.fixture
def sleepless():
    yield from running(StageConfig(stage_id=1, engine="count", name="talker"), SleeplessEngine())


def test_waking_an_engine_that_cannot_sleep_is_ok_and_only_sleep_says_it_cannot(sleepless):
    """A plain `omni wakeup` after `omni sleep --stage 0 --force` reached the other stages' engines too: each
    that cannot sleep answered 'cannot sleep on this platform' and the command exited 1. Awake is awake."""
    w, _ = sleepless
    assert w.command("WAKE_UP") == (True, "awake")
    ok, msg = w.command("SLEEP", {"level": 1})
    assert not ok and "SleeplessEngine cannot sleep on this platform" in msg, msg
    assert w.command("WAKE_UP") == (True, "awake") and not w.load_snapshot.read()["is_sleeping"]


class ReadyFdEngine(CountEngine):
    """Outputs come from elsewhere (like vLLM's EngineCore): the test queues them and the
    engine's eventfd says so; step() hands out what is queued."""

    def __init__(self):
        super().__init__()
        import os

        self.fd = os.eventfd(0, os.EFD_NONBLOCK)
        self.queued: list[EngineOutput] = []
        self.steps = 0
        self.lock = threading.Lock()

    def ready_fd(self):
        return self.fd

    def push(self, out: EngineOutput) -> None:
        import os

        with self.lock:
            self.queued.append(out)
        os.eventfd_write(self.fd, 1)

    def step(self) -> list[EngineOutput]:
        import os

        self.steps += 1
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass
        with self.lock:
            outs, self.queued = self.queued, []
        for o in outs:
            if o.finished:
                self.reqs.pop(o.request_id, None)
        return outs


def test_engine_with_ready_fd_is_stepped_when_it_has_output_not_in_a_loop():
    engine = ReadyFdEngine()
    w = StageWorker(StageConfig(stage_id=0, engine="ready", name="ready"), engine, token="secret", replica_id="s0r0")
    t = threading.Thread(target=w.run, kwargs={"grace_s": 1.0}, daemon=True)
    t.start()
    try:
        s = dealer(w.endpoint)
        assert hello(s).ok
        s.send(enc.encode(m.AddRequest(request_id="r1", prompt_token_ids=[10], sampling=SamplingParams(max_tokens=2))))
        deadline = threading.Event()
        deadline.wait(0.5)   # a measurement window, not a synchronisation: the request waits for output
        assert "r1" in engine.reqs
        # Stepped only to check liveness (every STEP_IDLE_S), not polled: a loop would step thousands of times.
        assert 1 <= engine.steps <= 10, engine.steps
        engine.push(EngineOutput(request_id="r1", token_ids=[11]))
        assert recv(s).token_ids == [11]
        engine.push(EngineOutput(request_id="r1", token_ids=[12], finished=True, finish_reason="stop", stop_reason=12))
        last = recv(s)
        assert last.token_ids == [12] and last.finished and last.stop_reason == 12
        # Output for a request nobody holds (aborted meanwhile) is read, not left to spin the loop.
        before = engine.steps
        engine.push(EngineOutput(request_id="gone", token_ids=[1]))
        deadline.wait(0.3)
        assert not engine.queued and engine.steps - before <= 2
    finally:
        w.stop()
        t.join(10)
    assert not t.is_alive()


class HoldEngine(CountEngine):
    """CountEngine that can hold a request (as the talker does under first_output_hold_ms)."""

    def __init__(self):
        super().__init__()
        self.held: dict[str, tuple[float, list]] = {}
        self.calls: list[tuple[str, str]] = []

    def can_hold(self) -> bool:
        return True

    def hold(self, rid: str, until: float) -> None:
        self.calls.append(("hold", rid))
        self.held[rid] = (until, self.reqs.pop(rid))

    def release(self, rid: str) -> None:
        self.calls.append(("release", rid))
        held = self.held.pop(rid, None)
        if held is not None:
            self.reqs[rid] = held[1]

    def held_until(self) -> float | None:
        return min(u for u, _ in self.held.values()) if self.held else None

    def step(self) -> list[EngineOutput]:
        for rid in [r for r, (u, _) in self.held.items() if u <= time.monotonic()]:
            self.reqs[rid] = self.held.pop(rid)[1]
        return super().step()

    def has_unfinished(self) -> bool:
        return bool(self.reqs) or (bool(self.held) and self.held_until() <= time.monotonic())


@pytest.fixture
def hold_worker():
    yield from running(StageConfig(stage_id=1, engine="count", name="talker", first_output_hold_ms=100), HoldEngine())


def send_held(w: StageWorker, rid: str, hold_ms: float):
    """A frontend's socket that sent one 3-token request with `hold_ms`."""
    s = dealer(w.endpoint)
    assert hello(s).ok
    s.send(enc.encode(m.AddRequest(request_id=rid, prompt_token_ids=[10], hold_ms=hold_ms,
                                   sampling=SamplingParams(max_tokens=3))))
    return s


def test_a_held_request_waits_for_its_release(hold_worker):
    w, engine = hold_worker
    s = send_held(w, "r1", 3_600_000)
    assert recv(s).token_ids == [11]
    s.send(enc.encode(m.Utility(1, "ping")))
    assert isinstance(recv(s), m.UtilityResult)     # nothing of r1 came before: it is held
    s.send(enc.encode(m.Release(["r1"])))
    assert [recv(s).token_ids for _ in range(2)] == [[12], [13]]
    assert engine.calls == [("hold", "r1"), ("release", "r1")]
    s.close()


def test_a_hold_ends_at_its_deadline_without_a_release(hold_worker):
    w, engine = hold_worker
    s = send_held(w, "r2", 20)
    assert [recv(s).token_ids for _ in range(3)] == [[11], [12], [13]]   # the loop woke at the deadline
    assert engine.calls == [("hold", "r2")]
    s.close()


def test_a_hold_on_an_engine_that_cannot_hold_is_refused_by_name(monkeypatch):
    from omni.config import parse
    from omni.engines import factory
    from omni.errors import ConfigError

    monkeypatch.setitem(factory.ENGINES, "count", lambda config, stage: CountEngine())
    config = parse({"model": "m", "stages": [
        {"stage_id": 0, "engine": "count", "name": "talker", "first_output_hold_ms": 100},
        {"stage_id": 1, "engine": "count", "inputs": [0], "final_output": True, "final_output_type": "audio"}]},
        source="x.yaml")
    with pytest.raises(ConfigError, match="stage 0 .talker.: first_output_hold_ms is set, but engine count cannot"):
        factory.build_engine(config, config.stage(0))
    assert isinstance(factory.build_engine(config, config.stage(1)), CountEngine)


class RunningCountEngine(CountEngine):
    def num_running(self) -> int:
        return len(self.reqs)


class QuietCountEngine(RunningCountEngine):
    """Steps like CountEngine but says nothing until a request's last token (a talker between chunks)."""

    def step(self) -> list[EngineOutput]:
        return [o for o in super().step() if o.finished]


def test_steps_with_work_report_their_time_and_batch():
    """Each step of an engine that computes in the stage counts once, with the requests it had
    ready: the batch sizes sum to the request-steps whatever the interleaving."""
    from omni.metrics import BATCH_BUCKETS, BATCH_KEY, STEP_BUCKETS, STEP_KEY, Histogram

    gen = running(StageConfig(stage_id=1, engine="count", name="counter"), RunningCountEngine())
    w, _ = next(gen)
    try:
        assert load_when(w, lambda load: True)["extra"].get(f"{BATCH_KEY}.sum") is None   # no work yet, nothing reported
        s = dealer(w.endpoint)
        assert hello(s).ok
        for rid in ("a", "b"):
            s.send(enc.encode(m.AddRequest(request_id=rid, prompt_token_ids=[1],
                                           sampling=SamplingParams(max_tokens=3))))
        outs = [recv(s) for _ in range(6)]
        assert sum(o.finished for o in outs) == 2
        extra = load_when(w, lambda load: load["extra"].get(f"{BATCH_KEY}.sum") == 6)["extra"]
        batch = Histogram.from_flat(BATCH_BUCKETS, BATCH_KEY, extra)
        steps = Histogram.from_flat(STEP_BUCKETS, STEP_KEY, extra)
        assert batch.sum == 6 and 3 <= sum(batch.counts) <= 6
        assert sum(steps.counts) == sum(batch.counts) and steps.sum > 0
        s.close()
    finally:
        next(gen, None)


def test_steps_without_output_count_the_requests_the_engine_had_ready():
    from omni.metrics import BATCH_BUCKETS, BATCH_KEY, Histogram

    gen = running(StageConfig(stage_id=1, engine="count", name="counter"), QuietCountEngine())
    w, _ = next(gen)
    try:
        s = dealer(w.endpoint)
        assert hello(s).ok
        s.send(enc.encode(m.AddRequest(request_id="q", prompt_token_ids=[1], sampling=SamplingParams(max_tokens=3))))
        assert recv(s).finished
        extra = load_when(w, lambda load: load["extra"].get(f"{BATCH_KEY}.sum") == 3)["extra"]
        batch = Histogram.from_flat(BATCH_BUCKETS, BATCH_KEY, extra)
        assert sum(batch.counts) == 3 and batch.sum == 3      # two quiet steps and the one that answered
        s.close()
    finally:
        next(gen, None)
