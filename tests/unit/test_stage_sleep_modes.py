"""A stage's SLEEP with vLLM's mode=abort ends its requests (each with an error that says why) and sleeps;
without it, a stage with work open refuses to sleep, as before. An engine that cannot sleep keeps its
requests: they are not ended for a sleep that would fail anyway."""

from __future__ import annotations

import pytest

from omni.config import StageConfig
from omni.engines.base import Engine, EngineError, SamplingParams
from omni.stage import messages as m
from tests.unit.test_stage_worker import CountEngine, dealer, enc, hello, load_when, recv, running


class StrictEngine(CountEngine):
    """Refuses to sleep with requests open, as every real engine does."""

    def sleep(self, level: int = 1) -> None:
        if self.reqs:
            raise EngineError(f"cannot sleep with {len(self.reqs)} request(s) in flight")
        self.sleeping = True


class SleeplessStrict(StrictEngine):
    can_sleep, sleep, is_sleeping = Engine.can_sleep, Engine.sleep, Engine.is_sleeping


@pytest.fixture
def strict():
    yield from running(StageConfig(stage_id=0, engine="count", name="thinker"), StrictEngine())


@pytest.fixture
def sleepless():
    yield from running(StageConfig(stage_id=1, engine="count", name="talker"), SleeplessStrict())


def start_long(w, rid: str = "long"):
    s = dealer(w.endpoint)
    assert hello(s).ok
    s.send(enc.encode(m.AddRequest(request_id=rid, prompt_token_ids=[0],
                                   sampling=SamplingParams(max_tokens=10_000_000))))
    assert recv(s).request_id == rid
    return s


def error_of(s, rid: str) -> m.RequestError:
    while not isinstance(msg := recv(s), m.RequestError):   # its outputs already sent come first
        assert msg.request_id == rid
    return msg


def test_sleep_with_mode_abort_ends_the_requests_in_flight_then_sleeps(strict):
    w, engine = strict
    s = start_long(w)
    ok, msg = w.command("SLEEP", {"level": 1})     # no mode: refused with work open, as before
    assert not ok and "cannot sleep with 1 request(s) in flight" in msg, msg
    assert not engine.sleeping
    assert w.command("SLEEP", {"level": 1, "mode": "abort"}) == (True, "sleeping")
    err = error_of(s, "long")
    assert err.kind == "unavailable" and "put to sleep with mode=abort" in err.message, err
    assert "long" in engine.aborted and engine.sleeping
    load_when(w, lambda load: load["in_flight"] == 0 and load["is_sleeping"])
    assert w.command("WAKE_UP") == (True, "awake")
    s.close()


def refused_keeping_the_request(w, engine, args: dict, says: str) -> None:
    s = start_long(w)
    ok, msg = w.command("SLEEP", args)
    assert not ok and says in msg, msg
    assert not engine.aborted and "long" in engine.reqs and not engine.is_sleeping()
    s.send(enc.encode(m.Abort(["long"])))
    s.close()


def test_sleep_with_an_unknown_mode_is_refused_and_ends_nothing(strict):
    refused_keeping_the_request(*strict, {"level": 1, "mode": "keep"}, "sleep mode 'keep' is not one of refuse, abort")


def test_mode_abort_on_an_engine_that_cannot_sleep_leaves_its_requests_alone(sleepless):
    refused_keeping_the_request(*sleepless, {"level": 1, "mode": "abort"}, "cannot sleep on this platform")
