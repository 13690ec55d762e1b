"""A stage whose loop has work and gets nowhere for pipeline.loop_stall_s stops heartbeating: a step that never
returns, or an engine computing elsewhere (vLLM) that gives no output. The master's lease then expires (DEAD) and
the frontends move its requests; a loop that moves again heartbeats again. Before, the keep-alive thread went on
heartbeating and the replica stayed READY."""

from __future__ import annotations

import threading

from omni.config import StageConfig
from omni.engines.base import EngineOutput, SamplingParams
from omni.master.client import MasterClient
from omni.master.configdiff import hash_config
from omni.master.server import MasterServer
from omni.stage import messages as m
from omni.stage.loop_watch import LoopWatch
from omni.stage.worker import StageWorker
from tests.unit.test_stage_load_snapshot import until
from tests.unit.test_stage_worker import CountEngine, ReadyFdEngine, dealer, enc, hello, recv

STAGE = StageConfig(stage_id=0, engine="count", name="counter")


class BlockingEngine(CountEngine):
    """Its step waits for `release` (a hung step: a deadlock, a collective whose peer is gone)."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()
        self.in_step = threading.Event()

    def step(self) -> list[EngineOutput]:
        self.in_step.set()
        assert self.release.wait(60), "the test never released the step"
        return super().step()


def start(engine, loop_stall_s: float):
    w = StageWorker(STAGE, engine, token="secret", replica_id="s0r0", loop_stall_s=loop_stall_s)
    t = threading.Thread(target=w.run, kwargs={"grace_s": 1.0}, daemon=True)
    t.start()
    return w, t


def stop(w, t) -> None:
    w.stop()
    t.join(10)
    assert not t.is_alive()


def add(s, rid: str, max_tokens: int = 3) -> None:
    s.send(enc.encode(m.AddRequest(request_id=rid, prompt_token_ids=[1], sampling=SamplingParams(max_tokens=max_tokens))))


def test_the_watch_says_wedged_past_the_bound_only_and_never_at_0():
    now = [100.0]
    w = LoopWatch(2.0, "stage 0", clock=lambda: now[0])
    now[0] += 10
    w.waiting()
    now[0] += 10
    assert w.wedged() is None     # idle: waiting for work is no stall
    w.stepping()                  # work came: counted from its first step
    now[0] += 2.0
    w.stepping()
    assert w.wedged() is None
    now[0] += 0.5
    assert w.wedged() is not None and "loop_stall_s 2 s" in w.wedged()
    w.progressed()
    assert w.wedged() is None
    now[0] += 2.5
    w.waiting()                   # its work ended, or its output waits for consumers (stall_timeout_s)
    assert w.wedged() is None
    off = LoopWatch(0, "stage 0", clock=lambda: now[0])
    off.stepping()
    now[0] += 1e6
    assert off.wedged() is None


def test_a_step_that_never_returns_wedges_the_loop_until_it_returns():
    loop_stall_s = 0.5
    engine = BlockingEngine()
    w, t = start(engine, loop_stall_s)
    s = dealer(w.endpoint)
    try:
        assert hello(s).ok
        threading.Event().wait(2 * loop_stall_s)   # a measurement window: an idle loop is never wedged
        assert w.loop_watch.wedged() is None
        add(s, "r1")
        assert engine.in_step.wait(10)
        until(lambda: w.loop_watch.wedged() is not None, "the hung step seen as a wedged loop", timeout=10 * loop_stall_s)
        assert "got nowhere" in w.loop_watch.wedged()
        engine.release.set()
        assert recv(s).token_ids == [2]
        until(lambda: w.loop_watch.wedged() is None, "the loop moving again")
    finally:
        engine.release.set()
        s.close()
        stop(w, t)


def test_steps_that_return_keep_the_loop_unwedged():
    class Slow(CountEngine):   # each step takes most of the bound; none passes it
        def step(self):
            threading.Event().wait(0.15)
            return super().step()

    w, t = start(Slow(), 0.3)
    s = dealer(w.endpoint)
    try:
        assert hello(s).ok
        add(s, "r1", max_tokens=8)
        seen = []
        while not recv(s).finished:
            seen.append(w.loop_watch.wedged())
        assert seen and seen == [None] * len(seen)
    finally:
        s.close()
        stop(w, t)


def test_an_engine_computing_elsewhere_is_wedged_without_output_and_not_with_it():
    engine = ReadyFdEngine()    # vLLM's shape: step() returns at once; only output says its core moved
    w, t = start(engine, 0.5)
    s = dealer(w.endpoint)
    try:
        assert hello(s).ok
        add(s, "r1")
        until(lambda: w.loop_watch.wedged() is not None, "no output for loop_stall_s", timeout=5)
        engine.push(EngineOutput(request_id="r1", token_ids=[2]))
        assert recv(s).token_ids == [2]
        until(lambda: w.loop_watch.wedged() is None, "an output as progress")
    finally:
        s.close()
        stop(w, t)


def test_a_wedged_stage_goes_dead_on_the_master_and_comes_back_when_its_step_returns():
    cfg = {"model": "m", "stages": [{"stage_id": 0, "engine_args": {}}]}
    server = MasterServer(cfg, hash_config(cfg), lease_ttl_s=1.0)
    server.start()
    engine = BlockingEngine()
    w, t = start(engine, 0.5)
    client = MasterClient(server.address)
    s = dealer(w.endpoint)
    try:
        client.register("STAGE", 0, config_hash=hash_config(cfg), pipeline_config=cfg, host="127.0.0.1",
                        endpoints={"channel": w.endpoint})
        client.start_keepalive(w.load_snapshot.read, lambda cmd: (True, ""), interval_s=0.1,
                               withhold=w.loop_watch.wedged)

        def state():
            return [r.state for r in client.get_status().replicas]

        until(lambda: state() == ["READY"], "the stage READY")
        assert hello(s).ok
        add(s, "r1")
        assert engine.in_step.wait(10)
        until(lambda: state() == ["DEAD"], "the wedged stage's lease expired", timeout=15)
        engine.release.set()
        assert recv(s).token_ids == [2]
        until(lambda: state() == ["READY"], "the stage registered again once its loop moved", timeout=15)
        assert client.registrations == 2
    finally:
        engine.release.set()
        s.close()
        client.close()
        stop(w, t)
        server.stop(grace=0.2)


def test_loop_stall_s_is_a_pipeline_key_0_turns_it_off_and_a_bad_one_is_named():
    import pytest

    from omni.config import parse
    from omni.errors import ConfigError

    base = {"model": "m", "stages": [{"stage_id": 0, "engine": "torch_lm", "final_output": True,
                                      "final_output_type": "text"}]}
    assert parse(dict(base), source="x.yaml").pipeline.loop_stall_s == 120.0
    assert parse({**base, "pipeline": {"loop_stall_s": 0}}, source="x.yaml").pipeline.loop_stall_s == 0
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=r"x.yaml: pipeline.loop_stall_s must be >= 0 and finite"):
            parse({**base, "pipeline": {"loop_stall_s": bad}}, source="x.yaml")


STAGE_PROCESS = """
import select, sys
from omni.config import loads_json
from omni.engines import factory
from omni.stage import main as stage_main
from tests.unit.test_stage_worker import CountEngine

class Hung(CountEngine):
    released = False

    def has_unfinished(self):
        return not self.released

    def step(self):   # hung until the test writes a line (a deadline of its own: 60 s)
        self.released = bool(select.select([sys.stdin], [], [], 60)[0])
        return []

factory.build_engine = lambda config, stage: Hung()
opts = stage_main.StageOptions(master_address=sys.argv[2], register_wait_s=30)
sys.exit(stage_main.run_stage(loads_json(open(sys.argv[1]).read()), 0, opts))
"""


def test_a_stage_process_whose_step_hangs_goes_dead_and_comes_back(tmp_path):
    """omni serve's stage process (run_stage) withholds its heartbeats while its step hangs. Before: READY
    throughout (the repro saw heartbeat_age 0.2 s at t=8 s with a 1.5 s lease)."""
    import json
    import os
    import subprocess
    import sys

    from omni.config import parse
    from tests.e2e.harness import REPO

    config = parse({"model": "m", "stages": [{"stage_id": 0, "engine": "torch_lm", "final_output": True,
                                              "final_output_type": "text"}],
                    "pipeline": {"lease_ttl_s": 1.0, "loop_stall_s": 1.0}}, source="x.yaml")
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    (tmp_path / "stage.py").write_text(STAGE_PROCESS)
    server = MasterServer(config.to_dict(), config.config_hash(), lease_ttl_s=1.0)
    server.start()
    client = MasterClient(server.address)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "stage.py"), str(tmp_path / "config.json"),
                             server.address], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def states():
            assert proc.poll() is None, proc.stderr.read()
            return [r.state for r in client.get_status().replicas]

        until(lambda: states() == ["READY"], "the stage registered", timeout=60)
        until(lambda: states() == ["DEAD"], "the hung stage's lease expired", timeout=20)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        until(lambda: states() == ["READY"], "the stage back once its step returned", timeout=20)
    finally:
        if proc.poll() is None:
            proc.stdin.close()   # a step still waiting returns
            proc.terminate()
        try:
            proc.wait(20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            proc.stderr.close()
            client.close()
            server.stop(grace=0.2)
