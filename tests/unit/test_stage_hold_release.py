"""A Release that reaches the stage before the request's first-output hold began ends that hold before it
begins (omni/stage/holds.py): the request is not held its full hold_ms."""

from __future__ import annotations

import threading

import pytest

from omni.config import StageConfig
from omni.engines.base import EngineOutput, SamplingParams
from omni.stage import messages as m
from tests.unit.test_stage_input_reads import GatedConsumer, _far_ref
from tests.unit.test_stage_worker import HoldEngine, dealer, enc, hello, recv, running

HOUR_MS = 3_600_000


class LateEngine(HoldEngine):
    """HoldEngine whose requests make no output until `go` (a talker's next sentence waiting for text)."""

    def __init__(self):
        super().__init__()
        self.go = threading.Event()

    def step(self) -> list[EngineOutput]:
        return super().step() if self.go.is_set() else []


@pytest.fixture
def late():
    yield from running(StageConfig(stage_id=1, engine="count", name="talker"), LateEngine(),
                       consumer=GatedConsumer())


def synced(s) -> None:
    """Everything sent on `s` before this was handled by the loop."""
    s.send(enc.encode(m.Utility(99, "ping")))
    assert isinstance(recv(s), m.UtilityResult)


def add(rid: str, **kw) -> bytes:
    return enc.encode(m.AddRequest(request_id=rid, prompt_token_ids=[10], hold_ms=HOUR_MS,
                                   sampling=SamplingParams(max_tokens=3), **kw))


def tokens(s, n: int) -> list[list[int]]:
    out = []
    for _ in range(n):
        assert s.poll(5000), f"held: got only {out}"   # before: held for hold_ms (an hour)
        out.append(recv(s).token_ids)
    return out


@pytest.mark.parametrize("before", ["admitted", "first-output"])
def test_a_release_before_the_hold_begins_ends_it(late, before):
    """Released while the request still waits for its remote read (admitted once it ends), or admitted with
    no output yet."""
    w, engine = late
    s = dealer(w.endpoint)
    assert hello(s).ok
    if before == "admitted":
        engine.go.set()
        s.send(add("r1", tensors={"x": _far_ref()}))
        assert w._consumer.started.wait(10)
    else:
        s.send(add("r1"))
    s.send(enc.encode(m.Release(["r1"])))
    synced(s)
    (w._consumer.gate if before == "admitted" else engine.go).set()   # the read ends, or the output comes
    assert tokens(s, 3) == [[11], [12], [13]]
    assert engine.calls == [("release", "r1")]
    s.close()


def test_a_release_is_forgotten_when_its_request_ends(late):
    w, engine = late
    engine.go.set()
    s = dealer(w.endpoint)
    assert hello(s).ok
    s.send(add("r1"))
    s.send(enc.encode(m.Release(["r1"])))
    assert tokens(s, 3) == [[11], [12], [13]]
    assert "r1" not in w._holds._released
    s.close()
