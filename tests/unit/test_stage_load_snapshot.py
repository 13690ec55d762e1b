"""The load a stage reports to the master: taken on its loop thread (the keep-alive thread never calls into the
engine, whose request tables that loop changes), and a load_fn that fails never reads as 'not draining,
awake' on the master."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from omni.config import StageConfig
from omni.engines.base import SamplingParams
from omni.master.client import MasterClient
from omni.master.configdiff import hash_config
from omni.master.server import MasterServer
from omni.stage import messages as m
from tests.unit.test_stage_worker import CountEngine, dealer, enc, hello, recv, running


class Readers(CountEngine):
    """Records the threads that read its load."""

    def __init__(self):
        super().__init__()
        self.readers: set[str] = set()

    def _seen(self) -> None:
        self.readers.add(threading.current_thread().name)

    def num_waiting(self) -> int:
        self._seen()
        return 0

    def num_running(self) -> int:
        self._seen()
        return len(self.reqs)

    def is_sleeping(self) -> bool:
        self._seen()
        return self.sleeping

    def load_extra(self) -> dict[str, float]:
        self._seen()
        return {}


def until(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.01)   # polling another thread's state, bounded


def test_the_keep_alive_reads_a_snapshot_and_never_the_engine():
    gen = running(StageConfig(stage_id=0, engine="count", name="counter"), Readers())
    w, engine = next(gen)
    try:
        engine.readers.clear()     # the constructor took the first snapshot on this thread
        s = dealer(w.endpoint)
        assert hello(s).ok
        s.send(enc.encode(m.AddRequest(request_id="r1", prompt_token_ids=[1], sampling=SamplingParams(max_tokens=3))))
        while not recv(s).finished:
            w.load_snapshot.read()            # as the keep-alive thread does, meanwhile
        until(lambda: w.load_snapshot.read()["requests_total"] == 1, "the finished request in the snapshot")
        assert threading.current_thread().name not in engine.readers and engine.readers
        # A command's effect is in the snapshot before its ack, so the heartbeat carrying the ack agrees.
        assert w.command("DRAIN") == (True, "draining") and w.load_snapshot.read()["draining"]
        assert w.command("SLEEP") == (True, "sleeping") and w.load_snapshot.read()["is_sleeping"]
        assert threading.current_thread().name not in engine.readers
        s.close()
    finally:
        next(gen, None)


def test_a_failed_load_read_keeps_the_last_one():
    gen = running(StageConfig(stage_id=0, engine="count", name="counter"), Readers())
    w, engine = next(gen)
    try:
        w.command("DRAIN")
        engine.num_waiting = lambda: 1 / 0
        w.load_snapshot.take()
        assert w.load_snapshot.read()["draining"]
    finally:
        next(gen, None)


def test_a_failing_load_fn_sends_the_last_good_load_or_none():
    c = MasterClient("127.0.0.1:1")
    reg = SimpleNamespace(lease_id="L", replica_id="s0r0")
    try:
        none_yet = c._heartbeat(reg, lambda: 1 / 0, [])
        assert none_yet.no_load and not none_yet.draining
        assert c._heartbeat(reg, lambda: {"draining": True, "is_sleeping": True}, []).draining
        for bad in (lambda: 1 / 0, lambda: {"queue_len": "many"}):
            hb = c._heartbeat(reg, bad, [])
            assert hb.draining and hb.is_sleeping and not hb.no_load
    finally:
        c.close()


def test_the_master_keeps_a_drain_and_sleep_through_heartbeats_without_a_load():
    cfg = {"model": "m", "stages": [{"stage_id": 0, "engine_args": {}}]}
    server = MasterServer(cfg, hash_config(cfg), lease_ttl_s=3.0)
    server.start()
    calls = [0]
    good = {"draining": True, "is_sleeping": True, "requests_total": 5}
    state = {"fail": False}

    def load_fn() -> dict:
        calls[0] += 1
        if state["fail"]:
            raise RuntimeError("OrderedDict mutated during iteration")
        return good

    stage = MasterClient(server.address)
    try:
        stage.register("STAGE", 0, config_hash=hash_config(cfg), pipeline_config=cfg, host="127.0.0.1")
        stage.start_keepalive(load_fn, lambda cmd: (True, ""), interval_s=0.05)

        def replica():
            return stage.get_status().replicas[0]

        until(lambda: replica().state == "DRAINING", "the stage's drain on the master")
        state["fail"] = True
        start = calls[0]
        until(lambda: calls[0] > start + 5, "heartbeats after the load read failed")
        r = replica()
        assert (r.state, r.draining, r.is_sleeping, r.requests_total) == ("DRAINING", True, True, 5)
    finally:
        stage.close()
        server.stop(grace=0.2)
